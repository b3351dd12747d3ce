// Baton's CPU kernels, one source compiled once per ISA (kernels/cpu_ops.py gives each
// build its flags and its op namespace, BATON_CPU_NS). Only ATen's tensor and
// op-registration headers: no pybind11, no torch C++ API, so a build takes seconds.
//
// Numerics follow HF's eager modules on T-typed (bf16, fp16, fp32) tensors: every value a
// torch op would round to T is rounded to T here too (round_as), and the rest is fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "prefill.h"
#include "qmm.h"
#include "rope_cache.h"
#include "vec.h"

namespace baton {

// f(T{}) for the tensor's element type T: fp32, bf16 or fp16.
template <typename F>
void by_dtype(at::ScalarType t, const char* op, F f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, op, ": ", t, " is not served");
  }
}

// -- RMSNorm, with the residual add before it fused in
//   residual given:  residual = T(x + residual); y = norm(residual)   (residual in place)
//   else:            y = norm(x)
//   norm(s) = T(w * T(s * r))             offset 0 (Llama, Qwen: HF's w * normed.to(T))
//             T(s * r * (offset + w))      offset != 0 (Gemma: in fp32, then cast)
//   with r = 1 / sqrt(mean(s^2) + eps) in fp32.
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                   at::Tensor& out, double eps, double offset) {
  const int64_t n = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0, os = out.stride(0);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = xp + i * xs;
      if (rp) {  // the sum, rounded as torch's add on T would, becomes the new residual
        T* r = rp + i * rs;
        for (int64_t j = 0; j < H; j += W) {
          const int k = int(std::min<int64_t>(W, H - j));
          store_n(r + j, load_n(src + j, k) + load_n(r + j, k), k);
        }
        src = r;
      }
      vf sq = vf{};
      for (int64_t j = 0; j < H; j += W) {
        vf v = load_n(src + j, int(std::min<int64_t>(W, H - j)));
        sq += v * v;
      }
      const float inv = 1.f / std::sqrt(sum(sq) / float(H) + float(eps));
      T* o = op + i * os;
      for (int64_t j = 0; j < H; j += W) {
        const int k = int(std::min<int64_t>(W, H - j));
        vf v = load_n(src + j, k) * inv, w = load_n(wp + j, k);
        store_n(o + j, offset != 0 ? v * (w + float(offset)) : w * round_as(v, src), k);
      }
    }
  });
}

void rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
              const at::Tensor& weight, at::Tensor& out, double eps, double offset) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous());
  TORCH_CHECK(!residual || (residual->stride(1) == 1 && residual->sizes() == x.sizes()));
  const at::Tensor* r = residual ? &*residual : nullptr;
  by_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows<scalar_t>(x, r, weight, out, eps, offset);
  });
}

// -- the gated MLP's activation: out = T(T(silu(gate)) * up), x = [gate | up] per row,
//   silu(g) = g / (1 + e^-g). (GELU-tanh stays torch's: torch computes 1 + tanh(y), which
//   cancels where tanh(y) is near -1, and matching its rounding there needs its tanh.)
template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = x.size(0), I = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = xp + i * xs;
      for (int64_t j = 0; j < I; j += W) {
        const int k = int(std::min<int64_t>(W, I - j));
        vf a = load_n(g + j, k), u = load_n(g + I + j, k);
        a = a / (1.f + exp(-a));
        store_n(op + i * os + j, round_as(a, g) * u, k);
      }
    }
  });
}

void silu_and_mul(const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 &&
              x.size(1) == 2 * out.size(1));
  by_dtype(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_rows<scalar_t>(x, out);
  });
}

void decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
            const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale,
            int64_t window, double softcap) {
  TORCH_CHECK(q.stride(2) == 1 && kc.stride(3) == 1 && out.stride(2) == 1);
  TORCH_CHECK(kc.strides() == vc.strides() && tables.dtype() == at::kInt &&
              lens.dtype() == at::kInt && q.size(1) % kc.size(0) == 0);
  by_dtype(q.scalar_type(), "decode", [&](auto tag) {
    using scalar_t = decltype(tag);
    decode_rows<scalar_t>(q, kc, vc, tables, lens, out, float(scale), window, float(softcap));
  });
}

// Every prefill chunk of a step (sequences first_seq.. of lens/starts), see prefill.h.
void prefill(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
             const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& starts,
             int64_t first_seq, at::Tensor& out, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.stride(2) == 1 && kc.stride(3) == 1 && out.stride(2) == 1);
  TORCH_CHECK(kc.strides() == vc.strides() && tables.dtype() == at::kInt &&
              lens.dtype() == at::kInt && starts.dtype() == at::kInt &&
              q.size(1) % kc.size(0) == 0);
  const int64_t d = q.size(2);
  by_dtype(q.scalar_type(), "prefill", [&](auto tag) {
    using scalar_t = decltype(tag);
    auto run = [&](auto c) {
      prefill_impl<decltype(c)::value, scalar_t>(q, kc, vc, tables, lens, starts, first_seq,
                                                 out, float(scale), window, float(softcap));
    };
    switch (d / W * (d % W == 0)) {
      case 1: return run(std::integral_constant<int, 1>{});
      case 2: return run(std::integral_constant<int, 2>{});
      case 4: return run(std::integral_constant<int, 4>{});
      case 8: return run(std::integral_constant<int, 8>{});
      case 16: return run(std::integral_constant<int, 16>{});
      case 32: return run(std::integral_constant<int, 32>{});
      case 64: return run(std::integral_constant<int, 64>{});
      default: TORCH_CHECK(false, "prefill: head_dim ", d, " is not served");
    }
  });
}

// RoPE on q and k, and k, v into the cache (rope_cache.h).
void rope_and_cache(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                    const at::Tensor& slots, int64_t kv_heads) {
  TORCH_CHECK(qk.stride(2) == 1 && v.stride(2) == 1 && cos.stride(1) == 1 &&
              sin.strides() == cos.strides() && kc.stride(3) == 1 &&
              kc.strides() == vc.strides() && slots.dtype() == at::kLong &&
              qk.size(2) % 2 == 0 && cos.size(1) * 2 == qk.size(2) &&
              cos.scalar_type() == qk.scalar_type() && v.scalar_type() == qk.scalar_type());
  by_dtype(qk.scalar_type(), "rope_and_cache", [&](auto tag) {
    using scalar_t = decltype(tag);
    rope_rows<scalar_t>(qk, v, cos, sin, kc, vc, slots, kv_heads);
  });
}

// -- x @ W^T with W kept quantized (qmm.h; the formats: kernels/quant.py)
// act_int8: bf16/fp16 activations may be quantized per block for VNNI's integer dot
// products, where this build has them (qmm.h); else, and for fp32, weight-only fp32.
void qmm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, int64_t fmt,
         int64_t k, bool act_int8, at::Tensor& out) {
  TORCH_CHECK(fmt >= kInt8 && fmt <= kQ4_1, "qmm: unknown format ", fmt);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1, "qmm: x must be [M, k]");
  TORCH_CHECK(fmt == kInt8 || k % QBLOCK == 0, "qmm: k must be a multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.element_size() == 1 &&
              w.size(1) == qrow_bytes(int(fmt), k), "qmm: weight rows do not match k");
  const int64_t N = w.size(0);
  TORCH_CHECK(fmt != kInt8 || (scales.scalar_type() == at::kFloat && scales.numel() == N &&
              scales.is_contiguous()), "qmm: int8 needs one fp32 scale per row");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == N &&
              out.scalar_type() == x.scalar_type(), "qmm: out must be [M, N] in x's dtype");
  const float* sp = fmt == kInt8 ? scales.data_ptr<float>() : nullptr;
  by_dtype(x.scalar_type(), "qmm", [&](auto tag) {
    using scalar_t = decltype(tag);
#ifdef BATON_QMM_VNNI
    if (act_int8 && k % QBLOCK == 0 && x.scalar_type() != at::kFloat) {
      qmm_int8_acts<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.size(0),
                              static_cast<const uint8_t*>(w.data_ptr()), sp, int(fmt), k, N,
                              out.data_ptr<scalar_t>());
      return;
    }
#endif
    qmm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.size(0),
                       static_cast<const uint8_t*>(w.data_ptr()), sp, int(fmt), k, N,
                       out.data_ptr<scalar_t>());
  });
}

void dequant(const at::Tensor& w, const at::Tensor& scales, int64_t fmt, int64_t k,
             at::Tensor& out) {
  TORCH_CHECK(fmt >= kInt8 && fmt <= kQ4_1 && (fmt == kInt8 || k % QBLOCK == 0) &&
              w.dim() == 2 && w.is_contiguous() && w.element_size() == 1 &&
              w.size(1) == qrow_bytes(int(fmt), k), "dequant: weight rows do not match k");
  const int64_t N = w.size(0);
  TORCH_CHECK(fmt != kInt8 || (scales.scalar_type() == at::kFloat && scales.numel() == N),
              "dequant: int8 needs one fp32 scale per row");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == N && out.size(1) == k,
              "dequant: out must be [N, k]");
  const float* sp = fmt == kInt8 ? scales.data_ptr<float>() : nullptr;
  by_dtype(out.scalar_type(), "dequant", [&](auto tag) {
    using scalar_t = decltype(tag);
    dequant_rows<scalar_t>(static_cast<const uint8_t*>(w.data_ptr()), sp, int(fmt), k, N,
                           out.data_ptr<scalar_t>());
  });
}

void per_token(const at::Tensor& x, at::Tensor& q, at::Tensor& sx) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && q.is_contiguous() &&
              q.scalar_type() == at::kChar && q.sizes() == x.sizes() &&
              sx.scalar_type() == at::kFloat && sx.numel() == x.size(0),
              "per_token: x [M, k], q int8 [M, k], sx fp32 [M]");
  by_dtype(x.scalar_type(), "per_token", [&](auto tag) {
    using scalar_t = decltype(tag);
    per_token_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.size(0), x.size(1),
                             q.data_ptr<int8_t>(), sx.data_ptr<float>());
  });
}

void rescale(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw,
             at::Tensor& out) {
  TORCH_CHECK(acc.is_contiguous() && acc.scalar_type() == at::kInt && out.is_contiguous() &&
              out.sizes() == acc.sizes() && sx.numel() == acc.size(0) &&
              sw.numel() == acc.size(1) && sx.scalar_type() == at::kFloat &&
              sw.scalar_type() == at::kFloat, "rescale: acc int32 [M, N], sx [M], sw [N]");
  by_dtype(out.scalar_type(), "rescale", [&](auto tag) {
    using scalar_t = decltype(tag);
    rescale_rows<scalar_t>(acc.data_ptr<int32_t>(), acc.size(0), acc.size(1),
                           sx.data_ptr<float>(), sw.data_ptr<float>(), out.data_ptr<scalar_t>());
  });
}

}  // namespace baton

// TORCH_LIBRARY pastes its namespace argument: one macro level expands BATON_CPU_NS first.
#define BATON_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define BATON_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

BATON_LIBRARY(BATON_CPU_NS, m) {
  m.def("rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, Tensor(b!) out, float eps, "
        "float offset) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("decode(Tensor q, Tensor kc, Tensor vc, Tensor tables, Tensor lens, Tensor(a!) out, "
        "float scale, int window, float softcap) -> ()");
  m.def("rope_and_cache(Tensor(a!) qk, Tensor v, Tensor cos, Tensor sin, Tensor(b!) kc, "
        "Tensor(c!) vc, Tensor slots, int kv_heads) -> ()");
  m.def("prefill(Tensor q, Tensor kc, Tensor vc, Tensor tables, Tensor lens, Tensor starts, "
        "int first_seq, Tensor(a!) out, float scale, int window, float softcap) -> ()");
  m.def("qmm(Tensor x, Tensor w, Tensor scales, int fmt, int k, bool act_int8, "
        "Tensor(a!) out) -> ()");
  m.def("dequant(Tensor w, Tensor scales, int fmt, int k, Tensor(a!) out) -> ()");
  m.def("per_token(Tensor x, Tensor(a!) q, Tensor(b!) sx) -> ()");
  m.def("rescale(Tensor acc, Tensor sx, Tensor sw, Tensor(a!) out) -> ()");
}

BATON_LIBRARY_IMPL(BATON_CPU_NS, m) {
  m.impl("rms_norm", &baton::rms_norm);
  m.impl("silu_and_mul", &baton::silu_and_mul);
  m.impl("decode", &baton::decode);
  m.impl("prefill", &baton::prefill);
  m.impl("rope_and_cache", &baton::rope_and_cache);
  m.impl("qmm", &baton::qmm);
  m.impl("dequant", &baton::dequant);
  m.impl("per_token", &baton::per_token);
  m.impl("rescale", &baton::rescale);
}
