// Decode attention over the paged cache: each decode row (one new token) reads its K and V
// through its block table, in place, once each. One work item is a row i, all its heads:
//
//   for each block b the row's keys touch (the window's only, with one):
//     for each KV head h, with the `group` query heads g that share it:
//       s[g, p] = scale * q_g . k_p      p over the block's positions, fp32
//       (soft-capped: softcap * tanh(s / softcap))
//       online softmax:  m' = max(m, max_p s);  c = e^(m - m')
//                        l = c l + sum_p e^(s - m');  acc = c acc + sum_p e^(s - m') v_p
//   o_g = acc_g / l_g
//
// so a block is read in the order it lies in a block-major cache (kernels/kv_layout.py: K
// of every head, then V), and nothing of the row's scores outlives its block. K and V are
// [kv_head, block, offset, head_dim] views with the same strides. Rows go to threads one
// at a time: rows of different lengths still finish together. With fewer rows than four
// per thread (batch 1), an item is one (row, KV head) instead, so every thread works.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"


namespace baton {

// One KV head's `group` query rows over positions off .. off + cnt of one block (k and v
// point at the block's first row of that head): the scores, the online softmax update,
// and the weighted values, as the diagram above.
template <typename T>
void block_update(const T* k, const T* v, int64_t stride, int64_t off, int64_t cnt, int64_t d,
                  int64_t chunks, int64_t group, int64_t bs, float softcap, const vf* qv,
                  vf* acc, float* s, float* m, float* l, vf* row) {
  for (int64_t p = 0; p < cnt; ++p) {
    const T* kr = k + (off + p) * stride;
    for (int64_t c = 0; c < chunks; ++c)  // the row widened once for every g
      row[c] = load_n(kr + c * W, int(std::min<int64_t>(W, d - c * W)));
    for (int64_t g = 0; g < group; ++g) {
      const vf* qg = &qv[g * chunks];
      vf dot = qg[0] * row[0];
      for (int64_t c = 1; c < chunks; ++c) dot += qg[c] * row[c];
      float x = sum(dot);
      if (softcap > 0) x = softcap * std::tanh(x / softcap);
      s[g * bs + p] = x;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = &s[g * bs];
    const float mx = std::max(m[g], *std::max_element(sg, sg + cnt));
    // e^(m - m') rescales what came before; the first block has nothing before it.
    const float c = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[g] - mx);
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
  for (int64_t p = 0; p < cnt; ++p) {
    const T* vr = v + (off + p) * stride;
    for (int64_t c = 0; c < chunks; ++c)
      row[c] = load_n(vr + c * W, int(std::min<int64_t>(W, d - c * W)));
    for (int64_t g = 0; g < group; ++g) {
      const float e = s[g * bs + p];
      vf* a = &acc[g * chunks];
      for (int64_t c = 0; c < chunks; ++c) a[c] += e * row[c];
    }
  }
}

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
  const int64_t heads_per_item = n < 4 * at::get_num_threads() ? 1 : KV;
  const int64_t items = n * (KV / heads_per_item);
#pragma omp parallel num_threads(item_threads(items))
  {
    // Per thread, per (KV head, g): q (scaled) and the accumulators as whole vectors (d
    // padded to W), the block's scores, the running max and sum.
    const int64_t rows = KV * group;
    std::vector<vf> qv(rows * chunks), acc(rows * chunks), row(chunks);
    std::vector<float> s(rows * bs), m(rows), l(rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t i = w / (KV / heads_per_item), len = sl[i];
      const int64_t h0 = w % (KV / heads_per_item) * heads_per_item, h1 = h0 + heads_per_item;
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      if (len <= first) continue;
      for (int64_t hg = h0 * group; hg < h1 * group; ++hg) {  // query head h * group + g
        const T* src = qp + i * qs0 + hg * qs1;
        for (int64_t c = 0; c < chunks; ++c)
          qv[hg * chunks + c] = load_n(src + c * W, int(std::min<int64_t>(W, d - c * W))) * scale;
      }
      std::fill(acc.begin(), acc.end(), vf{});
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t b = first / bs; b * bs < len; ++b) {
        const int64_t lo = std::max(first, b * bs), hi = std::min(len, (b + 1) * bs);
        const int64_t cnt = hi - lo, blk = int64_t(bt[i * bts + b]) * ks1;
        for (int64_t h = h0; h < h1; ++h)
          block_update(kp + blk + h * ks0, vp + blk + h * ks0, ks2, lo - b * bs, cnt, d, chunks,
                       group, bs, softcap, &qv[h * group * chunks], &acc[h * group * chunks],
                       &s[h * group * bs], &m[h * group], &l[h * group], row.data());
      }
      for (int64_t hg = h0 * group; hg < h1 * group; ++hg) {
        T* dst = op + i * os0 + hg * os1;
        const float inv = 1.f / l[hg];
        for (int64_t x = 0; x < chunks; ++x)
          store_n(dst + x * W, acc[hg * chunks + x] * inv, int(std::min<int64_t>(W, d - x * W)));
      }
    }
  }
}

}  // namespace baton
