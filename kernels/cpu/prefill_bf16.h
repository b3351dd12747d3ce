// prefill.h's row kernel for bf16 on CPUs with AVX-512 BF16: vdpbf16ps multiplies pairs of
// bf16 and adds both products into an fp32 lane, so one instruction does the work of two
// FMAs and reads half the bytes. The workspace holds the chunk's keys in bf16, in pairs:
//
//   Kp: tiles of 16 keys, [head_dim / 2][16 keys][2 dims]  (a lane n sums q[x] k_n[x] over
//       the pair x = 2i, 2i + 1: S[n] += q[2i] k_n[2i] + q[2i+1] k_n[2i+1])
//   Vp: pairs of keys,   [head_dim][2 keys]               (a lane x sums P[n] v_n[x] over
//       the pair n = 2j, 2j + 1)
//
// q is bf16 already (the model's value; the scale is applied to S in fp32). P is rounded
// to bf16 before P V, as HF's eager attention rounds its probabilities to the model dtype.
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "vec.h"

namespace baton {

constexpr bool BF16_PAIRS = true;

// Keys first..len of one (chunk, KV head) into Kp/Vp (zeros elsewhere: see prefill.h).
inline void fill_pairs(uint16_t* ws, int64_t d, int64_t lo, int64_t first, int64_t len,
                       const c10::BFloat16* kp, const c10::BFloat16* vp, const int32_t* table,
                       int64_t bs, int64_t ks0h, int64_t ks1, int64_t ks2) {
  const int64_t ntiles = (len - lo + W - 1) / W, npairs = (len - lo + 1) / 2;
  uint16_t* Kp = ws;
  uint16_t* Vp = ws + ntiles * d * W;
  std::fill(Kp, Vp + npairs * 2 * d, uint16_t(0));
  for (int64_t p = first; p < len; ++p) {
    const int64_t off = ks0h + int64_t(table[p / bs]) * ks1 + (p % bs) * ks2, rel = p - lo;
    const uint16_t* k = reinterpret_cast<const uint16_t*>(kp + off);
    const uint16_t* v = reinterpret_cast<const uint16_t*>(vp + off);
    uint16_t* kt = Kp + rel / W * d * W + (rel % W) * 2;
    uint16_t* vt = Vp + rel / 2 * 2 * d + rel % 2;
    for (int64_t x = 0; x < d; ++x) kt[x / 2 * 2 * W + x % 2] = k[x], vt[x * 2] = v[x];
  }
}

template <int C, int R>
void prefill_rows_bf16(const PrefillSeq& sq, int64_t h, int64_t group, int64_t row0,
                       int64_t rows, const c10::BFloat16* qp, int64_t qs0, int64_t qs1,
                       c10::BFloat16* op, int64_t os0, int64_t os1, const uint16_t* ws,
                       float scale, int64_t window, float softcap) {
  constexpr int64_t d = int64_t(C) * W;
  const int64_t ntiles = (sq.len - sq.lo + W - 1) / W;
  const uint16_t* Kp = ws;
  const uint16_t* Vp = ws + ntiles * d * W;
  uint32_t qq[R][d / 2];
  int64_t qpos[R];
  __m512 O[R][C];
  float m[R];
  vf l[R];  // lane-wise sums of P, added up at the end
  alignas(64) uint16_t pb[R][W];
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < R; ++r) {
    const int64_t j = row0 + std::min<int64_t>(r, rows - 1);  // pad with the last row
    const int64_t t = j / group, g = j % group;
    qpos[r] = sq.len - sq.q_len + t;
    std::memcpy(qq[r], qp + (sq.start + t) * qs0 + (h * group + g) * qs1, d * 2);
    for (int c = 0; c < C; ++c) O[r][c] = _mm512_setzero_ps();
    m[r] = ninf;
    l[r] = vf{};
  }
  const RowSpan span = row_span<R>(qpos, sq, window);
  const vf lane = lanes();
  for (int64_t k0 = span.first; k0 <= span.pmax; k0 += W) {
    const uint16_t* kt = Kp + (k0 - sq.lo) / W * d * W;
    __m512 S[R];
    for (int r = 0; r < R; ++r) S[r] = _mm512_setzero_ps();
    for (int64_t xp = 0; xp < d / 2; ++xp) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + xp * 2 * W);
      for (int r = 0; r < R; ++r)
        S[r] = _mm512_dpbf16_ps(S[r], (__m512bh)_mm512_set1_epi32(int(qq[r][xp])), kv);
    }
    const bool edge = span.edge(k0, sq.len, window);
    const vf pos = lane + float(k0);
    for (int r = 0; r < R; ++r) {
      vf p;
      const float c = softmax_step((vf)S[r] * scale, pos, qpos[r], sq.len, edge, window,
                                   softcap, m[r], l[r], p);
      if (c >= 0 && c != 1.f)
        for (int cc = 0; cc < C; ++cc) O[r][cc] = _mm512_mul_ps(O[r][cc], _mm512_set1_ps(c));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r]),
                         (__m256i)_mm512_cvtneps_pbh((__m512)p));
    }
    const int64_t n_end = std::min<int64_t>(W, std::min(sq.len, span.pmax + 1) - k0);
    const uint16_t* vt = Vp + (k0 - sq.lo) / 2 * 2 * d;
    for (int64_t jp = 0; jp < (n_end + 1) / 2; ++jp) {
      __m512bh pr[R];  // (P[r][2jp], P[r][2jp + 1]) in every lane
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, &pb[r][2 * jp], 4);
        pr[r] = (__m512bh)_mm512_set1_epi32(int(pair));
      }
      for (int cc = 0; cc < C; ++cc) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vt + jp * 2 * d + cc * 2 * W);
        for (int r = 0; r < R; ++r) O[r][cc] = _mm512_dpbf16_ps(O[r][cc], pr[r], vv);
      }
    }
  }
  for (int r = 0; r < R && r < rows; ++r) {
    const int64_t j = row0 + r, t = j / group, g = j % group;
    c10::BFloat16* dst = op + (sq.start + t) * os0 + (h * group + g) * os1;
    const float inv = 1.f / sum(l[r]);
    for (int cc = 0; cc < C; ++cc) store(dst + cc * W, (vf)O[r][cc] * inv);
  }
}

}  // namespace baton
#else
namespace baton {  // declared only: prefill.h names them in branches this build discards
constexpr bool BF16_PAIRS = false;
void fill_pairs(uint16_t*, int64_t, int64_t, int64_t, int64_t, const c10::BFloat16*,
                const c10::BFloat16*, const int32_t*, int64_t, int64_t, int64_t, int64_t);
template <int C, int R>
void prefill_rows_bf16(const PrefillSeq&, int64_t, int64_t, int64_t, int64_t,
                       const c10::BFloat16*, int64_t, int64_t, c10::BFloat16*, int64_t,
                       int64_t, const uint16_t*, float, int64_t, float);
}  // namespace baton
#endif
