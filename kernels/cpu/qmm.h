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

template <typename T>
void qmm_rows(const T* x, int64_t xs, int64_t M, const uint8_t* w, const float* scales,
              int fmt, int64_t k, int64_t N, T* out) {
  const int64_t kp = (k + W - 1) / W * W, rb = qrow_bytes(fmt, k);
  std::vector<float> xf(size_t(M * kp), 0.f);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < k; ++j) xf[size_t(i * kp + j)] = float(x[i * xs + j]);
  });
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

}  // namespace baton
