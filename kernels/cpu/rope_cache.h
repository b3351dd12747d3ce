// RoPE on q and k and the write of k and v into the paged cache, in one pass over each
// token: qk = [T, q_heads + kv_heads, d] (rotated in place), v = [T, kv_heads, d],
// cos/sin = [T, d/2] (the token's rows of the model-dtype tables). Neox-style halves:
//
//   (x1, x2) -> (T(T(x1 c) - x2 s), T(T(x2 c) + x1 s))
//
// rounded as the torch path rounds it (models/layers.py: apply_rope's mul, then addcmul).
// Token t's K and V rows go to slot s = slot_mapping[t]: block s / bs, offset s % bs, in
// [kv_head, block, offset, head_dim] views (kernels/kv_layout.py's head views).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>

#include "vec.h"

namespace baton {

template <typename T>
void rope_rows(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
               const at::Tensor& sin, const at::Tensor& kc, const at::Tensor& vc,
               const at::Tensor& slots, int64_t kv_heads) {
  const int64_t n = qk.size(0), heads = qk.size(1), d = qk.size(2), half = d / 2;
  const int64_t q_heads = heads - kv_heads, bs = kc.size(2);
  T* qp = qk.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* kcp = kc.data_ptr<T>();
  T* vcp = vc.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t qs0 = qk.stride(0), qs1 = qk.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t cs = cos.stride(0), ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * cs;
      const T* s = sp + t * cs;
      const int64_t slot = sl[t];
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qp + t * qs0 + h * qs1;
        for (int64_t j = 0; j < half; j += W) {
          const int k = int(std::min<int64_t>(W, half - j));
          const vf x1 = load_n(x + j, k), x2 = load_n(x + half + j, k);
          const vf cj = load_n(c + j, k), sj = load_n(s + j, k);
          store_n(x + j, round_as(x1 * cj, x) - x2 * sj, k);
          store_n(x + half + j, round_as(x2 * cj, x) + x1 * sj, k);
        }
        if (h < q_heads || slot < 0) continue;
        const int64_t at = (h - q_heads) * ks0 + slot / bs * ks1 + slot % bs * ks2;
        const T* vr = vp + t * vs0 + (h - q_heads) * vs1;
        std::copy(x, x + d, kcp + at);
        std::copy(vr, vr + d, vcp + at);
      }
    }
  });
}

}  // namespace baton
