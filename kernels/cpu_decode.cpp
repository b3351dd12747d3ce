// Decode attention over the paged cache, for CPU: see kernels/cpu_decode.py for the maths.
// Only ATen's tensor and op-registration headers, not torch/extension.h: this builds in a
// fraction of the time (no pybind11, no torch C++ API), and is called as torch.ops.baton_cpu.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

static inline float to_f(float x) { return x; }
static inline float to_f(c10::BFloat16 x) {
  uint32_t bits = uint32_t(x.x) << 16; float f; std::memcpy(&f, &bits, 4); return f;
}
static inline float to_f(c10::Half x) { return float(x); }

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
         const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
         double scale, int64_t window, double softcap) {
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t KV = kc.size(0), bs = kc.size(2), group = H / KV;
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* bt = tables.data_ptr<int32_t>();
  const int32_t* sl = lens.data_ptr<int32_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t bts = tables.stride(0);
  at::parallel_for(0, n * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / KV, h = w % KV;
      const int64_t len = sl[i];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t m = len - first;
      if (m <= 0) continue;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t x = 0; x < d; ++x)
          qf[g * d + x] = to_f(qp[i * qs0 + (h * group + g) * qs1 + x]) * float(scale);
      scores.assign(group * m, 0.f);
      for (int64_t p = first; p < len; ++p) {
        const T* k = kp + h * ks0 + int64_t(bt[i * bts + p / bs]) * ks1 + (p % bs) * ks2;
        float kf[512];
        for (int64_t x = 0; x < d; ++x) kf[x] = to_f(k[x]);
        for (int64_t g = 0; g < group; ++g) {
          float dot = 0.f;
          const float* qg = &qf[g * d];
          for (int64_t x = 0; x < d; ++x) dot += qg[x] * kf[x];
          if (softcap > 0) dot = float(softcap) * std::tanh(dot / float(softcap));
          scores[g * m + (p - first)] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * m];
        float mx = *std::max_element(s, s + m), sum = 0.f;
        for (int64_t p = 0; p < m; ++p) { s[p] = std::exp(s[p] - mx); sum += s[p]; }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < m; ++p) s[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = first; p < len; ++p) {
        const T* v = vp + h * ks0 + int64_t(bt[i * bts + p / bs]) * ks1 + (p % bs) * ks2;
        float vf[512];
        for (int64_t x = 0; x < d; ++x) vf[x] = to_f(v[x]);
        for (int64_t g = 0; g < group; ++g) {
          const float wgt = scores[g * m + (p - first)];
          float* a = &acc[g * d];
          for (int64_t x = 0; x < d; ++x) a[x] += wgt * vf[x];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t x = 0; x < d; ++x)
          op[i * os0 + (h * group + g) * os1 + x] = T(acc[g * d + x]);
    }
  });
}

// out[:n] = attention of decode rows q[:n] over their cached keys (see the Python doc).
void decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
            const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale,
            int64_t window, double softcap) {
  TORCH_CHECK(q.size(2) <= 512 && q.stride(2) == 1 && kc.stride(3) == 1 && out.stride(2) == 1);
  TORCH_CHECK(kc.strides() == vc.strides() && tables.dtype() == at::kInt);
  if (q.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(q, kc, vc, tables, lens, out, scale, window, softcap);
  else if (q.scalar_type() == at::kHalf)
    run<c10::Half>(q, kc, vc, tables, lens, out, scale, window, softcap);
  else
    run<float>(q, kc, vc, tables, lens, out, scale, window, softcap);
}

TORCH_LIBRARY(baton_cpu, m) {
  m.def("decode(Tensor q, Tensor kc, Tensor vc, Tensor tables, Tensor lens, Tensor(a!) out, "
        "float scale, int window, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) { m.impl("decode", &decode); }
