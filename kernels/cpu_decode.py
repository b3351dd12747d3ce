"""A C++ decode-attention kernel for CPU: each decode row reads its K and V straight from
the paged cache, through its block table, once each.

The torch path (kernels/torch_attn.py) gathers a row's blocks into a contiguous copy and
then runs batched matmuls of 3-row queries over it: the cache is read, written and read
again, and matmuls that small run far below the machine's rate. Decoding is bound by
memory, so this is where the time goes. Here, per (row, KV head), on one thread:

    pass 1, over the row's keys p (the window's, with one):  s[g, p] = scale * q_g . k_p
            (soft-capped where asked), in fp32, for the `group` query heads of that KV head
    softmax over p, in fp32
    pass 2, over the same positions:                          o_g = sum_p w[g, p] v_p

K and V are each read once, and converted to fp32 as they are read. It is compiled at
first use with torch's C++ extension builder (cached under TORCH_EXTENSIONS_DIR, and
built by `make install`). Where it cannot build (no C++ compiler), `load()` returns None,
says why once, and the torch path serves. Tested against kernels/reference.py.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
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
void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
         const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& out,
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
void decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
            torch::Tensor lens, torch::Tensor out, double scale, int64_t window,
            double softcap) {
  TORCH_CHECK(q.size(2) <= 512 && q.stride(2) == 1 && kc.stride(3) == 1 && out.stride(2) == 1);
  TORCH_CHECK(kc.strides() == vc.strides() && tables.dtype() == torch::kInt32);
  if (q.scalar_type() == torch::kBFloat16)
    run<c10::BFloat16>(q, kc, vc, tables, lens, out, scale, window, softcap);
  else if (q.scalar_type() == torch::kHalf)
    run<c10::Half>(q, kc, vc, tables, lens, out, scale, window, softcap);
  else
    run<float>(q, kc, vc, tables, lens, out, scale, window, softcap);
}
"""

_module = None
_failed: str | None = None


def load():
    """The compiled module, or None (with the reason logged once) where it cannot build.
    BATON_CPU_KERNELS=0 turns it off."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        _failed = "BATON_CPU_KERNELS=0"
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline(name="baton_cpu_decode", cpp_sources=_SOURCE,
                              functions=["decode"],
                              extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                              extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers: the torch path serves
        _failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("CPU decode kernel unavailable, using the torch path (%s)", _failed)
    return _module


def decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
           scale: float, window: int | None, softcap: float | None) -> None:
    """out[:n] for the first n = seq_lens.numel() rows of `query`, one token each."""
    n = seq_lens.shape[0]
    load().decode(query[:n], key_cache, value_cache, block_tables[:n], seq_lens,
                  out[:n], scale, window or 0, softcap or 0.0)


if __name__ == "__main__":  # `make install` builds it once, ahead of the first engine
    print("CPU decode kernel:", "built" if load() is not None else f"unavailable ({_failed})")
