// Prefill attention over the paged cache, every prefill chunk of a step in one call: chunk i
// has q_len new tokens at positions L - q_len .. L - 1 (L = seq_lens[i]) whose K/V are in
// the cache already, with its cached prefix; token at P sees keys k <= P (and, with a
// window, k > P - window), soft-capped where asked.
//
// Phase 1, per (chunk, KV head): the chunk's keys, widened to fp32, into a workspace:
//
//   Kt: tiles of W key positions, each [head_dim][W] (a tile's K transposed: one vector
//       load gives one dimension of W keys)        Vf: [position][head_dim]
//
// Phase 2, per (chunk, KV head, 32 new tokens): R query rows at a time (rows are
// (token, query head) pairs of that KV head, token-major), flash-style over the key tiles
// the rows see:
//
//   S[r]  = scale * sum_x q[r][x] * Kt[x]          R vectors of W scores: one load, R FMAs
//   m'    = max(m, max S[r]);  P[r] = e^(S[r] - m') (0 where masked)
//   l     = l e^(m - m') + sum P[r];  O[r] = O[r] e^(m - m') + sum_n P[r][n] V[n]
//
// then O[r] / l. R and C = head_dim / W are compile-time, so O (R x C vectors) lives in
// registers: R x C <= 24 with AVX-512's 32 registers, <= 12 otherwise.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "vec.h"

namespace baton {

constexpr int64_t TOKENS_PER_ITEM = 32;

struct PrefillSeq {
  int64_t start, q_len, len;  // first row in q, new tokens, keys (cached + new)
  int64_t first;              // first key any new token sees (with a window; else 0)
  int64_t lo;                 // `first` rounded down to a tile: keys before it read as 0
  int64_t ws;                 // offset of this chunk's workspace (per KV head: ws + h * per)
  int64_t per;                // workspace elements per KV head
};

// The keys R rows at positions qpos[] see: tiles from `first` (tile-aligned, from the
// chunk's `lo`) to the one holding pmax. A tile is an edge where some key of it may be
// hidden from some row (causal, past the end, outside the window): only those are masked.
struct RowSpan {
  int64_t pmin, pmax, first;
  bool edge(int64_t k0, int64_t len, int64_t window) const {
    return k0 + W - 1 > pmin || len - k0 < W || (window > 0 && k0 <= pmax - window);
  }
};

template <int R>
RowSpan row_span(const int64_t (&qpos)[R], const PrefillSeq& sq, int64_t window) {
  RowSpan s{qpos[0], qpos[0], sq.lo};
  for (int r = 1; r < R; ++r)
    s.pmin = std::min(s.pmin, qpos[r]), s.pmax = std::max(s.pmax, qpos[r]);
  if (window > 0) s.first = std::max(s.first, (s.pmin - window + 1) / W * W);
  s.first = sq.lo + (s.first - sq.lo) / W * W;
  return s;
}

inline vf lanes() {  // 0, 1, ..., W - 1
  vf v;
  for (int i = 0; i < W; ++i) v[i] = float(i);
  return v;
}

// One row's online-softmax step over one tile of W keys at positions `pos` (scores s,
// scaled): masked where `edge` says some key may be hidden from the row (causal, past the
// end, outside the window), soft-capped; m and l updated. Returns P (0 where masked) in p
// and the factor the row's O must be scaled by (e^(m - m'); 0 before any key), or -1 where
// the row sees none of the tile nor anything before it (p all 0; leave O alone).
inline float softmax_step(vf s, vf pos, int64_t qpos, int64_t len, bool edge, int64_t window,
                          float softcap, float& m, vf& l, vf& p) {
  const float ninf = -std::numeric_limits<float>::infinity();
  if (softcap > 0) s = softcap * tanh(s / softcap);
  vi keep = pos == pos;  // all lanes
  if (edge) {
    keep = (pos <= float(qpos)) & (pos < float(len));
    if (window > 0) keep = keep & (pos > float(qpos - window));
  }
  s = keep ? s : splat(ninf);
  const float mx = std::max(m, max(s));
  if (mx == ninf) {
    p = vf{};
    return -1.f;
  }
  p = keep ? exp(s - mx) : vf{};
  const float c = m == ninf ? 0.f : std::exp(m - mx);
  l = l * c + p;
  m = mx;
  return c;
}

}  // namespace baton

#include "prefill_bf16.h"

namespace baton {

template <int C, int R, typename T>
void prefill_rows(const PrefillSeq& sq, int64_t h, int64_t group, int64_t row0, int64_t rows,
                  const T* qp, int64_t qs0, int64_t qs1, T* op, int64_t os0, int64_t os1,
                  const float* ws, float scale, int64_t window, float softcap) {
  constexpr int64_t d = int64_t(C) * W;
  const int64_t ntiles = (sq.len - sq.lo + W - 1) / W;
  const float* Kt = ws;                   // [ntiles][d][W]
  const float* Vf = ws + ntiles * d * W;  // [len - lo][d]
  float qs[R][d];
  int64_t qpos[R];
  vf O[R][C];
  float m[R];
  vf l[R];  // lane-wise sums of P, added up at the end
  alignas(64) float ps[R][W];
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < R; ++r) {
    const int64_t j = row0 + std::min<int64_t>(r, rows - 1);  // pad with the last row
    const int64_t t = j / group, g = j % group;
    qpos[r] = sq.len - sq.q_len + t;
    const T* src = qp + (sq.start + t) * qs0 + (h * group + g) * qs1;
    for (int64_t x = 0; x < d; ++x) qs[r][x] = float(src[x]) * scale;
    for (int c = 0; c < C; ++c) O[r][c] = vf{};
    m[r] = ninf;
    l[r] = vf{};
  }
  const RowSpan span = row_span<R>(qpos, sq, window);
  const vf lane = lanes();
  for (int64_t k0 = span.first; k0 <= span.pmax; k0 += W) {
    const float* kt = Kt + (k0 - sq.lo) / W * d * W;
    vf S[R];
    for (int r = 0; r < R; ++r) S[r] = vf{};
    for (int64_t x = 0; x < d; ++x) {
      const vf kx = load(kt + x * W);
      for (int r = 0; r < R; ++r) S[r] += qs[r][x] * kx;
    }
    const bool edge = span.edge(k0, sq.len, window);
    const vf pos = lane + float(k0);
    for (int r = 0; r < R; ++r) {
      vf p;
      const float c = softmax_step(S[r], pos, qpos[r], sq.len, edge, window, softcap, m[r],
                                   l[r], p);
      if (c >= 0 && c != 1.f)
        for (int cc = 0; cc < C; ++cc) O[r][cc] *= c;
      store(ps[r], p);
    }
    const int64_t n_end = std::min<int64_t>(W, std::min(sq.len, span.pmax + 1) - k0);
    for (int64_t n = 0; n < n_end; ++n) {
      const float* v = Vf + (k0 - sq.lo + n) * d;
      vf vv[C];
      for (int cc = 0; cc < C; ++cc) vv[cc] = load(v + cc * W);
      for (int r = 0; r < R; ++r) {
        const float p = ps[r][n];
        for (int cc = 0; cc < C; ++cc) O[r][cc] += p * vv[cc];
      }
    }
  }
  for (int r = 0; r < R && r < rows; ++r) {
    const int64_t j = row0 + r, t = j / group, g = j % group;
    T* dst = op + (sq.start + t) * os0 + (h * group + g) * os1;
    const float inv = 1.f / sum(l[r]);
    for (int cc = 0; cc < C; ++cc) store(dst + cc * W, O[r][cc] * inv);
  }
}

// Keys first..len of one (chunk, KV head) into Kt/Vf, widened. Zeros before `first` (never
// read from the cache, and masked): a 0 weight times garbage there could still be NaN.
template <typename T>
void fill_floats(float* ws, int64_t d, int64_t lo, int64_t first, int64_t len, const T* kp,
                 const T* vp, const int32_t* table, int64_t bs, int64_t ks0h, int64_t ks1,
                 int64_t ks2) {
  const int64_t ntiles = (len - lo + W - 1) / W;
  float* Kt = ws;
  float* Vf = Kt + ntiles * d * W;
  std::fill(Kt, Kt + ntiles * d * W, 0.f);
  std::fill(Vf, Vf + (first - lo) * d, 0.f);
  for (int64_t p = first; p < len; ++p) {
    const int64_t off = ks0h + int64_t(table[p / bs]) * ks1 + (p % bs) * ks2;
    float* kt = Kt + (p - lo) / W * d * W + (p - lo) % W;
    float* vt = Vf + (p - lo) * d;
    for (int64_t x = 0; x < d; ++x) kt[x * W] = float(kp[off + x]), vt[x] = float(vp[off + x]);
  }
}

template <int C, typename T>
void prefill_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& starts,
                  int64_t first_seq, at::Tensor& out, float scale, int64_t window,
                  float softcap) {
#ifndef BATON_PREFILL_R
  constexpr int R = std::max(1, std::min(6, (W == 16 ? 24 : 12) / C));
#else
  constexpr int R = BATON_PREFILL_R;
#endif
  constexpr int64_t d = int64_t(C) * W;
  const int64_t n = lens.size(0), H = q.size(1), KV = kc.size(0), bs = kc.size(2);
  const int64_t group = H / KV;
  const int32_t* sl = lens.data_ptr<int32_t>();
  const int32_t* st = starts.data_ptr<int32_t>();
  const int32_t* bt = tables.data_ptr<int32_t>();
  const int64_t bts = tables.stride(0);
  // bf16 with AVX-512 BF16: the workspace in bf16 pairs (prefill_bf16.h); else fp32.
  constexpr bool pairs = BF16_PAIRS && std::is_same_v<T, c10::BFloat16>;
  using E = std::conditional_t<pairs, uint16_t, float>;
  std::vector<PrefillSeq> seqs;
  int64_t total = 0;
  for (int64_t i = first_seq; i < n; ++i) {
    PrefillSeq s;
    s.start = st[i], s.q_len = st[i + 1] - st[i], s.len = sl[i];
    const int64_t first_q = s.len - s.q_len;
    s.first = window > 0 ? std::max<int64_t>(0, first_q - window + 1) : 0;
    s.lo = s.first / W * W;
    const int64_t ntiles = (s.len - s.lo + W - 1) / W;
    s.per = ntiles * d * W + (s.len - s.lo + 1) / 2 * 2 * d;
    s.ws = total;
    total += s.per * KV;
    seqs.push_back(s);
  }
  // Not zeroed here: fill_floats / fill_pairs zero every element a tile may read.
  std::unique_ptr<E[]> ws(new E[total]);
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  // Phase 1: keys and values of each (chunk, KV head), widened, K in transposed tiles.
  at::parallel_for(0, int64_t(seqs.size()) * KV, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      const PrefillSeq& s = seqs[w / KV];
      const int64_t h = w % KV, i = first_seq + w / KV;
      E* dst = ws.get() + s.ws + h * s.per;
      if constexpr (pairs)
        fill_pairs(dst, d, s.lo, s.first, s.len, kp, vp, bt + i * bts, bs, h * ks0, ks1, ks2);
      else
        fill_floats(dst, d, s.lo, s.first, s.len, kp, vp, bt + i * bts, bs, h * ks0, ks1, ks2);
    }
  });
  // Phase 2: (chunk, KV head, 32 new tokens) items, longest chunks' items first.
  struct Item { int64_t seq, h, t0; };
  std::vector<Item> items;
  for (int64_t s = 0; s < int64_t(seqs.size()); ++s)
    for (int64_t t0 = 0; t0 < seqs[s].q_len; t0 += TOKENS_PER_ITEM)
      for (int64_t h = 0; h < KV; ++h) items.push_back({s, h, t0});
  // Later tokens see more keys: handed out first, so the threads finish together.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return seqs[a.seq].len - seqs[a.seq].q_len + a.t0 > seqs[b.seq].len - seqs[b.seq].q_len + b.t0;
  });
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t num_items = int64_t(items.size());
#pragma omp parallel for num_threads(item_threads(num_items)) schedule(dynamic, 1)
  for (int64_t w = 0; w < num_items; ++w) {
    const Item& it = items[w];
    const PrefillSeq& s = seqs[it.seq];
    const int64_t tokens = std::min(TOKENS_PER_ITEM, s.q_len - it.t0);
    const int64_t rows = tokens * group, row_base = it.t0 * group;
    const E* base = ws.get() + s.ws + it.h * s.per;
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int64_t n = std::min<int64_t>(R, rows - r0);
      if constexpr (pairs)
        prefill_rows_bf16<C, R>(s, it.h, group, row_base + r0, n, qp, qs0, qs1, op, os0, os1,
                                base, scale, window, softcap);
      else
        prefill_rows<C, R, T>(s, it.h, group, row_base + r0, n, qp, qs0, qs1, op, os0, os1,
                              base, scale, window, softcap);
    }
  }
}

}  // namespace baton
