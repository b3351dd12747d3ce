// A vector of W fp32 lanes, written once with GCC's vector extensions and compiled once
// per ISA (kernels/cpu_ops.py) at that ISA's register width: 16 lanes (zmm) with AVX-512,
// 8 (ymm) with AVX2, 4 (xmm) in the portable build. No intrinsics, so every build runs the
// same arithmetic; the compiler fuses a * b + c into an FMA where the ISA has one.
//
// bf16 is the top half of an fp32: widening is a 16-bit shift; narrowing rounds to
// nearest-even (torch's rounding) and keeps NaN a quiet NaN.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <algorithm>
#include <cstring>

namespace baton {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX2__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

inline vf splat(float x) { return vf{} + x; }

// -- loads and stores of W elements, any of the three element types
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline vf load(const c10::BFloat16* p) {
  vh h; std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v; std::memcpy(&v, &u, sizeof v); return v;
}
inline vf load(const c10::Half* p) {
  float tmp[W];
  for (int i = 0; i < W; ++i) tmp[i] = float(p[i]);
  return load(tmp);
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline void store(c10::BFloat16* p, vf v) {
  vu u; std::memcpy(&u, &v, sizeof u);
  vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest, ties to even
  vi nan = v != v;
  r = nan ? vu{} + 0x7fc0u : r;
  vh h = __builtin_convertvector(r, vh);
  std::memcpy(p, &h, sizeof h);
}
inline void store(c10::Half* p, vf v) {
  for (int i = 0; i < W; ++i) p[i] = c10::Half(v[i]);
}

// The first k <= W elements; the other lanes read as 0 and are not written.
template <typename T> inline vf load_n(const T* p, int k) {
  if (k == W) return load(p);
  T tmp[W] = {};
  for (int i = 0; i < k; ++i) tmp[i] = p[i];
  return load(tmp);
}
template <typename T> inline void store_n(T* p, vf v, int k) {
  if (k == W) return store(p, v);
  T tmp[W];
  store(tmp, v);
  for (int i = 0; i < k; ++i) p[i] = tmp[i];
}

// Rounded as the model dtype would round it: what a torch op on T-typed tensors returns.
inline vf round_as(vf v, const float*) { return v; }
inline vf round_as(vf v, const c10::BFloat16*) {  // as store() rounds, in registers
  vu u; std::memcpy(&u, &v, sizeof u);
  vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  vf out; std::memcpy(&out, &r, sizeof out);
  return v != v ? v : out;
}
inline vf round_as(vf v, const c10::Half* t) {
  c10::Half tmp[W]; store(tmp, v); (void)t; return load(tmp);
}

// Horizontal sum as a tree: fold the upper half onto the lower until one lane is left.
inline float sum(vf v) {
#if defined(__AVX512F__)
  typedef float v8 __attribute__((vector_size(32)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(__AVX2__)
  typedef float v8 __attribute__((vector_size(32)));
  v8 a = v;
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
  typedef float v4 __attribute__((vector_size(16)));
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
  typedef float v4 __attribute__((vector_size(16)));
  v4 b = v;
#endif
  b = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return b[0] + b[1];
}
inline float max(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }

// Threads for items of uneven cost, handed out one at a time (OpenMP's dynamic schedule)
// by `#pragma omp for` inside `#pragma omp parallel num_threads(item_threads(n))`: torch's
// intra-op thread count, or 1 inside one of its parallel regions. at::parallel_for splits
// a range into static halves, and rows of sorted lengths would then end on one thread.
inline int item_threads(int64_t n) {
  if (at::in_parallel_region()) return 1;
  return int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n)));
}

// e^x, within 2 ulp of expf over [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two
// parts, so r is exact), e^r by its degree-6 Taylor polynomial, 2^n put into the
// exponent bits. Inputs are clamped to that range: below, e^x < 1.2e-38 (and 0 is what
// a softmax wants there); above, fp32 overflows anyway. NaN stays NaN.
inline vf exp(vf x) {
  const vf in = x;
  x = vmin(vmax(x, splat(-87.0f)), splat(88.0f));
  vf n = x * 1.44269504f;
  n = __builtin_convertvector(__builtin_convertvector(n + (n >= 0 ? splat(0.5f) : splat(-0.5f)), vi), vf);
  vf r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  vf p = splat(1.f / 720);
  p = p * r + 1.f / 120; p = p * r + 1.f / 24; p = p * r + 1.f / 6;
  p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale; std::memcpy(&scale, &e, sizeof scale);
  vf out = p * scale;
  return in != in ? in : out;
}

// tanh(x) = 1 - 2 / (e^{2x} + 1): exact limits at +-inf (+-1), NaN stays NaN.
inline vf tanh(vf x) { return 1.f - 2.f / (exp(2.f * x) + 1.f); }

}  // namespace baton
