// Decode attention over the paged cache: each decode row (one new token) reads its K and V
// through its block table, in place, once each. One work item is (row i, KV head h) and
// the `group` query heads that share h:
//
//   for each block b the row's keys touch (the window's only, with one):
//       s[g, p] = scale * q_g . k_p      p over the block's positions, fp32
//       (soft-capped: softcap * tanh(s / softcap))
//       online softmax:  m' = max(m, max_p s);  c = e^(m - m')
//                        l = c l + sum_p e^(s - m');  acc = c acc + sum_p e^(s - m') v_p
//   o_g = acc_g / l_g
//
// so a block's K rows and then its V rows are read back to back, and nothing of the row's
// scores outlives its block. K and V are [kv_head, block, offset, head_dim] views with the
// same strides (any layout whose (head, block) tile is bs rows of head_dim elements).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace baton {

template <typename T>
void decode_rows(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                 const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                 float scale, int64_t window, float softcap) {
  const int64_t n = lens.size(0), H = q.size(1), d = q.size(2);
  const int64_t KV = kc.size(0), bs = kc.size(2), group = H / KV;
  const int64_t chunks = (d + W - 1) / W;
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
    // Per thread: q (scaled) and the accumulators as whole vectors, d padded to W.
    std::vector<vf> qv(group * chunks), acc(group * chunks), row(chunks);
    std::vector<float> s(group * bs), m(group), l(group);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / KV, h = w % KV, len = sl[i];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      if (len <= first) continue;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + i * qs0 + (h * group + g) * qs1;
        for (int64_t c = 0; c < chunks; ++c)
          qv[g * chunks + c] = load_n(src + c * W, int(std::min<int64_t>(W, d - c * W))) * scale;
      }
      std::fill(acc.begin(), acc.end(), vf{});
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t b = first / bs; b * bs < len; ++b) {
        const int64_t lo = std::max(first, b * bs), hi = std::min(len, (b + 1) * bs);
        const int64_t off = h * ks0 + int64_t(bt[i * bts + b]) * ks1;
        const int64_t cnt = hi - lo;
        for (int64_t p = lo; p < hi; ++p) {
          const T* k = kp + off + (p - b * bs) * ks2;
          for (int64_t c = 0; c < chunks; ++c)  // the row widened once for every g
            row[c] = load_n(k + c * W, int(std::min<int64_t>(W, d - c * W)));
          for (int64_t g = 0; g < group; ++g) {
            const vf* qg = &qv[g * chunks];
            vf dot = qg[0] * row[0];
            for (int64_t c = 1; c < chunks; ++c) dot += qg[c] * row[c];
            float x = sum(dot);
            if (softcap > 0) x = softcap * std::tanh(x / softcap);
            s[g * bs + (p - lo)] = x;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* sg = &s[g * bs];
          const float mx = std::max(m[g], *std::max_element(sg, sg + cnt));
          // e^(m - m') rescales what came before; the first block has nothing before it.
          const float c = m[g] == -std::numeric_limits<float>::infinity() ? 0.f
                                                                          : std::exp(m[g] - mx);
          vf total = vf{};
          for (int64_t p = 0; p < cnt; p += W) {
            const int k = int(std::min<int64_t>(W, cnt - p));
            vf e = exp(load_n(sg + p, k) - mx);
            store_n(sg + p, e, k);
            total += k == W ? e : load_n(sg + p, k);  // lanes past k are not the row's
          }
          l[g] = l[g] * c + sum(total);
          m[g] = mx;
          if (c != 1.f)
            for (int64_t x = 0; x < chunks; ++x) acc[g * chunks + x] *= c;
        }
        for (int64_t p = lo; p < hi; ++p) {
          const T* v = vp + off + (p - b * bs) * ks2;
          for (int64_t c = 0; c < chunks; ++c)
            row[c] = load_n(v + c * W, int(std::min<int64_t>(W, d - c * W)));
          for (int64_t g = 0; g < group; ++g) {
            const float e = s[g * bs + (p - lo)];
            vf* a = &acc[g * chunks];
            for (int64_t c = 0; c < chunks; ++c) a[c] += e * row[c];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + i * os0 + (h * group + g) * os1;
        const float inv = 1.f / l[g];
        for (int64_t x = 0; x < chunks; ++x)
          store_n(dst + x * W, acc[g * chunks + x] * inv, int(std::min<int64_t>(W, d - x * W)));
      }
    }
  });
}

}  // namespace baton
