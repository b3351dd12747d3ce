// out[M, N] = x[M, K] @ W^T for W kept quantized (kernels/quant.py has the formats):
// weight-only, the arithmetic in fp32 on the exactly dequantized weights.
//
//   x (model dtype) ──to fp32 once──> xf [M, Kp]        Kp = K rounded up to W lanes
//   for each chunk of MB rows of xf (so the chunk stays in L2):
//     threads share the tiles of R weight rows:
//       dequantize R rows into the thread's scratch [R, Kp] (fp32, zero past K and N)
//       for each group of up to 4 rows of the chunk: R x 4 dot products in registers
//
// A decode step (M <= MB) reads every weight byte once: at batch 1 it is bound by that
// read, which is what quantized weights shrink.
#pragma once
#include <cmath>
#include <vector>

#include "vec.h"

namespace baton {

constexpr int QBLOCK = 32;  // weights per GGUF block
constexpr int QR = 4;       // weight rows per tile
constexpr int64_t QMB = 64; // rows of x per chunk

enum QFormat { kInt8 = 0, kQ8_0 = 1, kQ4_0 = 2, kQ4_1 = 3 };

inline int64_t qrow_bytes(int fmt, int64_t k) {
  switch (fmt) {
    case kInt8: return k;
    case kQ8_0: return k / QBLOCK * (2 + QBLOCK);
    case kQ4_0: return k / QBLOCK * (2 + QBLOCK / 2);
    default: return k / QBLOCK * (4 + QBLOCK / 2);
  }
}

// GCC lowers a vector conversion from bytes to scalar code: the widening is spelled
// with the ISA's instruction where there is one (vpmovsxbd / vpmovzxbd), and so is fp16.
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

inline float half_at(const uint8_t* p) {
  uint16_t h; std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  c10::Half v; std::memcpy(&v, &h, 2); return float(v);
#endif
}

// W bytes at p, widened to W int32 lanes: as int8 (signed) or uint8.
template <bool Signed> inline vi widen(const uint8_t* p) {
  vi out;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i v = Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&out, &v, sizeof out);
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i v = Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  std::memcpy(&out, &v, sizeof out);
#else
  for (int i = 0; i < W; ++i) out[i] = Signed ? int32_t(int8_t(p[i])) : int32_t(p[i]);
#endif
  return out;
}
inline vf bytes_signed(const uint8_t* p) { return __builtin_convertvector(widen<true>(p), vf); }

// One row of K weights into dst (fp32): d * q (int8 with d = the row's scale, q8_0),
// d * (q - 8) (q4_0), d * q + m (q4_1); a 4-bit block's byte j is weights j and j + 16.
inline void dequant_row(int fmt, const uint8_t* row, float scale, int64_t k, float* dst) {
  if (fmt == kInt8) {
    int64_t j = 0;
    for (; j + W <= k; j += W) store(dst + j, bytes_signed(row + j) * scale);
    for (; j < k; ++j) dst[j] = float(int8_t(row[j])) * scale;
    return;
  }
  const int64_t blocks = k / QBLOCK;
  const int64_t bytes = qrow_bytes(fmt, QBLOCK);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    float* out = dst + b * QBLOCK;
    const float d = half_at(blk);
    if (fmt == kQ8_0) {
      for (int j = 0; j < QBLOCK; j += W) store(out + j, bytes_signed(blk + 2 + j) * d);
      continue;
    }
    const uint8_t* nib = blk + (fmt == kQ4_1 ? 4 : 2);
    const float m = fmt == kQ4_1 ? half_at(blk + 2) : 0.f;
    for (int j = 0; j < QBLOCK / 2; j += W) {
      const vi q = widen<false>(nib + j);
      vf lo = __builtin_convertvector(q & 15, vf), hi = __builtin_convertvector(q >> 4, vf);
      if (fmt == kQ4_0) {
        store(out + j, (lo - 8.f) * d);
        store(out + QBLOCK / 2 + j, (hi - 8.f) * d);
      } else {
        store(out + j, lo * d + m);
        store(out + QBLOCK / 2 + j, hi * d + m);
      }
    }
  }
}

// MR rows of x (stride kp) against the QR rows of w (stride kp): acc[m][r] in fp32.
template <int MR>
inline void qdot_tile(const float* x, const float* w, int64_t kp, float out[4][QR]) {
  vf acc[MR][QR] = {};
  for (int64_t j = 0; j < kp; j += W) {
    vf wv[QR];
    for (int r = 0; r < QR; ++r) wv[r] = load(w + r * kp + j);
    for (int m = 0; m < MR; ++m) {
      const vf xv = load(x + m * kp + j);
      for (int r = 0; r < QR; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < QR; ++r) out[m][r] = sum(acc[m][r]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BATON_QMM_VNNI 1
// -- The integer path (bf16/fp16 activations, few rows; VNNI's u8 x s8 dot products):
// x quantized per 32-column block as llama.cpp's Q8 activations are,
//   qx = round(x / sx), sx = max|x| / 127, sq = sum(qx)   per (row, block),
// and each weight block as unsigned bytes u with w = a * u + c (a, c per block):
//   q4_0  u = q,        a = d,  c = -8 d       q4_1  u = q,  a = d,  c = m
//   q8_0  u = q + 128,  a = d,  c = -128 d     int8  u = q + 128,  a = 1,  c = -128
// so that  sum_j x_j w_j ~= sum_b sx_b (a_b dot(u_b, qx_b) + c_b sq_b),  the dot in int32
// (vpdpbusd), and for int8 the row's scale multiplies the whole.
struct QActs {
  int64_t blocks;         // of the row, padded to a multiple of 8 (zeros past K)
  std::vector<int8_t> q;  // [M, blocks * 32]
  std::vector<float> s;   // [M, blocks]: sx
  std::vector<float> cs;  // [M, blocks]: sx * sq
};

template <typename T>
QActs quantize_acts(const T* x, int64_t xs, int64_t M, int64_t k) {
  const int64_t blocks = (k / QBLOCK + 7) / 8 * 8;
  QActs a{blocks, std::vector<int8_t>(size_t(M * blocks * QBLOCK), 0),
          std::vector<float>(size_t(M * blocks), 0.f),
          std::vector<float>(size_t(M * blocks), 0.f)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < k / QBLOCK; ++b) {
      float v[QBLOCK], amax = 0.f;
      for (int j = 0; j < QBLOCK; ++j) {
        v[j] = float(x[m * xs + b * QBLOCK + j]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sq = 0;
      int8_t* q = a.q.data() + (m * blocks + b) * QBLOCK;
      for (int j = 0; j < QBLOCK; ++j) {
        q[j] = int8_t(std::nearbyint(v[j] * inv));
        sq += q[j];
      }
      a.s[size_t(m * blocks + b)] = amax / 127.f;
      a.cs[size_t(m * blocks + b)] = amax / 127.f * float(sq);
    }
  return a;
}

// Weight block b of a row as 32 unsigned bytes u (in weight order).
inline __m256i unsigned_block(int fmt, const uint8_t* row, int64_t b) {
  if (fmt == kInt8 || fmt == kQ8_0) {
    const uint8_t* p = fmt == kInt8 ? row + b * QBLOCK : row + b * (2 + QBLOCK) + 2;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80)));
  }
  const int64_t bytes = fmt == kQ4_1 ? 4 + QBLOCK / 2 : 2 + QBLOCK / 2;
  const __m128i nib = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(row + b * bytes + bytes - 16));
  const __m128i lo = _mm_and_si128(nib, _mm_set1_epi8(0x0f));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(nib, 4), _mm_set1_epi8(0x0f));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// a and c (above) of blocks b0 .. b0 + 7 of a row (0 past `blocks`), as 8 lanes each.
inline void block_coefs(int fmt, const uint8_t* row, int64_t b0, int64_t blocks, __m256& a,
                        __m256& c) {
  if (fmt == kInt8) {
    a = _mm256_set1_ps(1.f);
    c = _mm256_set1_ps(-128.f);
    return;
  }
  const int64_t bytes = qrow_bytes(fmt, QBLOCK);
  const uint8_t* p = row + b0 * bytes;
  // Lanes by 16-bit inserts, not through memory (a store then a wider load stalls).
  auto half = [&](int i, int at) -> int {
    uint16_t h = 0;
    if (b0 + i < blocks) std::memcpy(&h, p + i * bytes + at, 2);
    return h;
  };
  __m128i d = _mm_setzero_si128(), m = _mm_setzero_si128();
#define BATON_LANE(i)                                   \
  d = _mm_insert_epi16(d, half(i, 0), i);               \
  if (fmt == kQ4_1) m = _mm_insert_epi16(m, half(i, 2), i);
  BATON_LANE(0) BATON_LANE(1) BATON_LANE(2) BATON_LANE(3)
  BATON_LANE(4) BATON_LANE(5) BATON_LANE(6) BATON_LANE(7)
#undef BATON_LANE
  a = _mm256_cvtph_ps(d);
  c = fmt == kQ4_1 ? _mm256_cvtph_ps(m)
                   : _mm256_mul_ps(a, _mm256_set1_ps(fmt == kQ4_0 ? -8.f : -128.f));
}

// [sum(v[0]), ..., sum(v[7])] of eight vectors of 8 int32 lanes.
inline __m256i sum8(const __m256i v[8]) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
  // lo = [0123 halves of v0..v3 | the other halves]: add the two 128-bit halves across.
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                          _mm256_permute2x128_si256(lo, hi, 0x31));
}

template <typename T>
void qmm_int8_acts(const T* x, int64_t xs, int64_t M, const uint8_t* w, const float* scales,
                   int fmt, int64_t k, int64_t N, T* out) {
  const int64_t blocks = k / QBLOCK, rb = qrow_bytes(fmt, k);
  const QActs acts = quantize_acts(x, xs, M, k);
  const int64_t bp = acts.blocks;
  // Eight blocks at a time: their integer dots, summed to one lane each, are scaled by
  // one vector multiply-add, and their a and c come in one fp16 conversion. One row at a
  // time: two sharing the activations' loads measured slower (registers spill).
  at::parallel_for(0, N, 2, [&](int64_t nb, int64_t ne) {
    for (int64_t n = nb; n < ne; ++n) {
      const uint8_t* row = w + n * rb;
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* qx = acts.q.data() + m * bp * QBLOCK;
        __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
        for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
          __m256i dots[8];
          for (int i = 0; i < 8; ++i) {
            const int64_t b = b0 + i;
            dots[i] = b < blocks
                ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), unsigned_block(fmt, row, b),
                                      _mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(qx + b * QBLOCK)))
                : _mm256_setzero_si256();
          }
          __m256 a, c;
          block_coefs(fmt, row, b0, blocks, a, c);
          const __m256 sx = _mm256_loadu_ps(acts.s.data() + m * bp + b0);
          const __m256 cs = _mm256_loadu_ps(acts.cs.data() + m * bp + b0);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8(dots)), _mm256_mul_ps(a, sx), acc);
          off = _mm256_fmadd_ps(c, cs, off);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc, off));
        float total = 0.f;
        for (float l : lanes) total += l;
        out[m * N + n] = T(scales ? total * scales[n] : total);
      }
    }
  });
}
#endif

// int8 rows, few rows of x: the row's scale factored out of its sum, so each weight is
// widened and multiplied once, with no scratch copy: out = s_n * sum_j x_j q_nj.
inline void int8_dots(const float* xf, int64_t M, int64_t kp, const uint8_t* w, int64_t k,
                      const float* scales, int64_t N, float* acc_out) {
  at::parallel_for(0, (N + QR - 1) / QR, 4, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      const int64_t n0 = t * QR, rows = std::min<int64_t>(QR, N - n0);
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xf + m * kp;
        vf acc[QR] = {};
        int64_t j = 0;
        for (; j + W <= k; j += W) {
          const vf xv = load(xm + j);
          for (int r = 0; r < QR; ++r)
            if (r < rows) acc[r] += xv * bytes_signed(w + (n0 + r) * k + j);
        }
        for (int64_t r = 0; r < rows; ++r) {
          float total = sum(acc[r]);
          for (int64_t jj = j; jj < k; ++jj) total += xm[jj] * float(int8_t(w[(n0 + r) * k + jj]));
          acc_out[m * N + n0 + r] = total * scales[n0 + r];
        }
      }
    }
  });
}

template <typename T>
void qmm_rows(const T* x, int64_t xs, int64_t M, const uint8_t* w, const float* scales,
              int fmt, int64_t k, int64_t N, T* out) {
  const int64_t kp = (k + W - 1) / W * W, rb = qrow_bytes(fmt, k);
  std::vector<float> xf(size_t(M * kp), 0.f);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < k; ++j) xf[size_t(i * kp + j)] = float(x[i * xs + j]);
  });
  if (fmt == kInt8 && M < 16) {
    std::vector<float> acc(size_t(M * N));
    int8_dots(xf.data(), M, kp, w, k, scales, N, acc.data());
    for (int64_t i = 0; i < M * N; ++i) out[i] = T(acc[size_t(i)]);
    return;
  }
  const int64_t tiles = (N + QR - 1) / QR;
  for (int64_t m0 = 0; m0 < M; m0 += QMB) {
    const int64_t mend = std::min(M, m0 + QMB);
    at::parallel_for(0, tiles, 1, [&](int64_t tb, int64_t te) {
      std::vector<float> scratch(size_t(QR * kp), 0.f);
      float acc[4][QR];
      for (int64_t t = tb; t < te; ++t) {
        const int64_t n0 = t * QR, rows = std::min<int64_t>(QR, N - n0);
        for (int64_t r = 0; r < rows; ++r)
          dequant_row(fmt, w + (n0 + r) * rb, scales ? scales[n0 + r] : 0.f, k,
                      scratch.data() + r * kp);
        for (int64_t r = rows; r < QR; ++r)
          std::fill_n(scratch.data() + r * kp, kp, 0.f);
        for (int64_t m = m0; m < mend; m += 4) {
          const float* xm = xf.data() + m * kp;
          const int mr = int(std::min<int64_t>(4, mend - m));
          switch (mr) {
            case 4: qdot_tile<4>(xm, scratch.data(), kp, acc); break;
            case 3: qdot_tile<3>(xm, scratch.data(), kp, acc); break;
            case 2: qdot_tile<2>(xm, scratch.data(), kp, acc); break;
            default: qdot_tile<1>(xm, scratch.data(), kp, acc); break;
          }
          for (int i = 0; i < mr; ++i)
            for (int64_t r = 0; r < rows; ++r) out[(m + i) * N + n0 + r] = T(acc[i][r]);
        }
      }
    });
  }
}

// Every row of W dequantized into out [N, K] (T): for many rows of x, a dense matmul
// over these beats the fp32 tiles above, and reading W once more is cheap beside it.
template <typename T>
void dequant_rows(const uint8_t* w, const float* scales, int fmt, int64_t k, int64_t N,
                  T* out) {
  const int64_t kp = (k + W - 1) / W * W, rb = qrow_bytes(fmt, k);
  at::parallel_for(0, N, 16, [&](int64_t nb, int64_t ne) {
    std::vector<float> row(size_t(kp), 0.f);
    for (int64_t n = nb; n < ne; ++n) {
      dequant_row(fmt, w + n * rb, scales ? scales[n] : 0.f, k, row.data());
      int64_t j = 0;
      for (; j + W <= k; j += W) store(out + n * k + j, load(row.data() + j));
      for (; j < k; ++j) out[n * k + j] = T(row[size_t(j)]);
    }
  });
}

// -- W8A8's two passes around oneDNN's int8 matmul (kernels/quant.py _w8a8):
//   per_token:  qx = round(x / sx), sx = max|x| / 127 per row   (symmetric int8)
//   rescale:    out = T(acc * sx[m] * sw[n])
template <typename T>
void per_token_rows(const T* x, int64_t xs, int64_t M, int64_t k, int8_t* q, float* sx) {
  at::parallel_for(0, M, 16, [&](int64_t mb, int64_t me) {
    for (int64_t m = mb; m < me; ++m) {
      const T* row = x + m * xs;
      float amax = 0.f;
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(float(row[j])));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t j = 0; j < k; ++j) q[m * k + j] = int8_t(std::nearbyint(float(row[j]) * inv));
      sx[m] = amax / 127.f;
    }
  });
}

template <typename T>
void rescale_rows(const int32_t* acc, int64_t M, int64_t N, const float* sx, const float* sw,
                  T* out) {
  at::parallel_for(0, M, 16, [&](int64_t mb, int64_t me) {
    for (int64_t m = mb; m < me; ++m)
      for (int64_t n = 0; n < N; ++n)
        out[m * N + n] = T(float(acc[m * N + n]) * sx[m] * sw[n]);
  });
}

}  // namespace baton
