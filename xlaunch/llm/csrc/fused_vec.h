// Vector helpers of xlaunch.llm's fused operators: 16 floats at a time, loaded from and stored to
// fp32, bf16 and fp16 storage, with a masked tail. AVX-512 (F, BW, DQ; AVX512_BF16 for rounding when
// present) under __AVX512F__; two AVX registers under AVX2 + FMA + F16C (the avx2 level); else a plain
// 16-float struct the compiler vectorizes (baseline).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define XLAUNCH_LLM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define XLAUNCH_LLM_AVX2 1
#endif

// A switch over the dtypes the kernels take (fp32, bf16, fp16): scalar_t inside the body.
#define XLAUNCH_LLM_DISPATCH(dtype, name, ...)                                            \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)               \
                                      AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)        \
                                          AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace xlaunch_llm {

constexpr int kLanes = 16;

#ifdef XLAUNCH_LLM_AVX512

struct V16 {
  __m512 v;
};

inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset(float x) { return {_mm512_set1_ps(x)}; }
inline V16 operator+(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 operator/(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float hsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float hmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline __mmask16 tail_mask(int n) { return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u); }

inline V16 vload(const float* p, int n = 16) {
  return {n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(tail_mask(n), p)};
}
inline V16 vload(const c10::BFloat16* p, int n = 16) {
  __m256i h = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                      : _mm256_maskz_loadu_epi16(tail_mask(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline V16 vload(const c10::Half* p, int n = 16) {
  __m256i h = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                      : _mm256_maskz_loadu_epi16(tail_mask(n), p);
  return {_mm512_cvtph_ps(h)};
}

inline void vstore(float* p, V16 a, int n = 16) {
  if (n >= 16) _mm512_storeu_ps(p, a.v); else _mm512_mask_storeu_ps(p, tail_mask(n), a.v);
}
// float -> bf16 bits, round to nearest even (NaN stays NaN), as torch's conversion.
inline __m256i to_bf16_bits(__m512 a) {
#ifdef __AVX512BF16__
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a));
#else
  __m512i bits = _mm512_castps_si512(a);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}
inline void vstore(c10::BFloat16* p, V16 a, int n = 16) {
  __m256i h = to_bf16_bits(a.v);
  if (n >= 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  else _mm256_mask_storeu_epi16(p, tail_mask(n), h);
}
inline void vstore(c10::Half* p, V16 a, int n = 16) {
  __m256i h = _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (n >= 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  else _mm256_mask_storeu_epi16(p, tail_mask(n), h);
}

// exp(x) as 2^k * p(r), |r| <= ln2/2, degree-6 polynomial (relative error ~2e-7); 0 below e^-87.3
// (-inf -> 0), x above 88.7 -> exp(88.7).
inline V16 vexp(V16 x) {
  __m512 a = _mm512_max_ps(_mm512_min_ps(x.v, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-88.0f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(1.44269504089f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), a);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  // Below the smallest normal result: exactly 0 (so exp(-inf) adds nothing to a softmax).
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-87.3f), _CMP_GE_OQ), _mm512_scalef_ps(p, k))};
}

#elif defined(XLAUNCH_LLM_AVX2)

// Two AVX registers. The portable struct below left GCC storing every intermediate to the stack and
// reducing each key's dot product lane by lane: cache_attention ran at about 1 G multiply-adds/s.
struct V16 {
  __m256 lo, hi;
};

inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline V16 operator+(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 operator/(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
// a > b ? a : b per lane, as the portable path (vmaxps: its first operand where greater, else its second).
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
// The portable path's order: halves added, then quarters, pairs, the last two.
inline float hsum(V16 a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
}
inline float hmax(V16 a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}
inline __m256i tail_mask8(int n) {   // lanes below n set: none for n <= 0, all 8 for n >= 8
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline V16 vload(const float* p, int n = 16) {
  if (n >= 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, tail_mask8(n)),
          _mm256_maskload_ps(p + 8, tail_mask8(n - 8))};
}
// 16 values of 16 bits: the whole chunk, or the tail copied into zeros (no read past p + n).
inline __m256i load_halves(const void* p, int n) {
  if (n >= 16) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint16_t tmp[16] = {};
  if (n > 0) std::memcpy(tmp, p, sizeof(uint16_t) * size_t(n));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
}
inline V16 vload(const c10::BFloat16* p, int n = 16) {
  const __m256i h = load_halves(p, n);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16))};
}
inline V16 vload(const c10::Half* p, int n = 16) {
  const __m256i h = load_halves(p, n);
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}

inline void vstore(float* p, V16 a, int n = 16) {
  if (n >= 16) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
    return;
  }
  _mm256_maskstore_ps(p, tail_mask8(n), a.lo);
  _mm256_maskstore_ps(p + 8, tail_mask8(n - 8), a.hi);
}
inline void store_halves(void* p, __m256i h, int n) {
  if (n >= 16) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), h);
  } else if (n > 0) {
    alignas(32) uint16_t tmp[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
    std::memcpy(p, tmp, sizeof(uint16_t) * size_t(n));
  }
}
// float -> bf16 bits, round to nearest even; a NaN becomes torch's 0x7fc0 (c10::BFloat16's conversion).
inline __m256i bf16_bits8(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}
inline void vstore(c10::BFloat16* p, V16 a, int n = 16) {
  // packus works within 128-bit lanes: lo 0-3, hi 0-3, lo 4-7, hi 4-7; the permute puts them in order
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(a.lo), bf16_bits8(a.hi));
  store_halves(p, _mm256_permute4x64_epi64(packed, 0xd8), n);
}
inline void vstore(c10::Half* p, V16 a, int n = 16) {
  const __m128i lo = _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m128i hi = _mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  store_halves(p, _mm256_set_m128i(hi, lo), n);
}

#endif

#ifndef XLAUNCH_LLM_AVX512   // exp: one polynomial in GCC's generic vectors (AVX2 and portable alike)

// exp(x): the AVX-512 path's method in GCC's generic vectors, which every level compiles to its own
// vector instructions (std::exp per lane stays a scalar libm call, and a loop over lanes with the
// selects below is not vectorized). 2^k * p(r); k rounded to nearest by adding 1.5 * 2^23 (no
// SSE4.1 round needed); 2^k built in the exponent bits (k = 128 as 2 * 2^127). NaN and x < -87.3
// give 0, x above 88.7 exp(88.7), as on AVX-512.
#if defined(__AVX__)
constexpr int kExpLanes = 8;              // one ymm register: wider generic vectors are split lane by lane
#else
constexpr int kExpLanes = 4;              // one xmm register (SSE2, every x86-64)
#endif
typedef float Floats __attribute__((vector_size(4 * kExpLanes)));
typedef int32_t Ints __attribute__((vector_size(4 * kExpLanes)));

// mask ? a : b per lane, as bit operations (GCC splits a vector ?: into scalar selects).
inline Floats select(Ints mask, Floats a, Floats b) { return (Floats)(((Ints)a & mask) | ((Ints)b & ~mask)); }

inline Floats exp_lanes(Floats x) {
  const Floats zero = {}, low = zero - 88.0f, high = zero + 88.7f;
  Floats a = select(x >= low, x, low);                     // NaN compares false: -88
  a = select(a > high, high, a);
  const Floats shifter = zero + 12582912.0f;               // 1.5 * 2^23
  const Floats k = (a * 1.44269504089f + shifter) - shifter;
  Floats r = a - k * 0.693145751953125f;
  r = r - k * 1.428606765330187e-06f;
  Floats p = zero + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  Ints exponent = __builtin_convertvector(k, Ints);
  const Ints over = exponent > 127;                         // -1 where k = 128: 2 * 2^127
  p = p * (__builtin_convertvector(over & 1, Floats) + 1.0f);
  exponent = exponent + over;
  const Floats scale = (Floats)((exponent + 127) << 23);
  return select(x >= zero - 87.3f, p * scale, zero);
}

#endif  // !XLAUNCH_LLM_AVX512

#if defined(XLAUNCH_LLM_AVX2)

inline V16 vexp(V16 in) { return {(__m256)exp_lanes((Floats)in.lo), (__m256)exp_lanes((Floats)in.hi)}; }

#elif !defined(XLAUNCH_LLM_AVX512)   // portable: a 16-float struct the compiler vectorizes as it can

struct V16 {
  float v[16];
};

#define XLAUNCH_LLM_EACH(expr) \
  V16 r;                      \
  for (int i = 0; i < 16; ++i) r.v[i] = (expr); \
  return r

inline V16 vzero() { XLAUNCH_LLM_EACH(0.0f); }
inline V16 vset(float x) { XLAUNCH_LLM_EACH(x); }
inline V16 operator+(V16 a, V16 b) { XLAUNCH_LLM_EACH(a.v[i] + b.v[i]); }
inline V16 operator-(V16 a, V16 b) { XLAUNCH_LLM_EACH(a.v[i] - b.v[i]); }
inline V16 operator*(V16 a, V16 b) { XLAUNCH_LLM_EACH(a.v[i] * b.v[i]); }
inline V16 operator/(V16 a, V16 b) { XLAUNCH_LLM_EACH(a.v[i] / b.v[i]); }
inline V16 fma(V16 a, V16 b, V16 c) { XLAUNCH_LLM_EACH(a.v[i] * b.v[i] + c.v[i]); }
inline V16 vmax(V16 a, V16 b) { XLAUNCH_LLM_EACH(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }

inline V16 vexp(V16 in) {
  V16 out;
  for (int i = 0; i < 16; i += kExpLanes) {
    Floats x;
    std::memcpy(&x, in.v + i, sizeof x);
    const Floats e = exp_lanes(x);
    std::memcpy(out.v + i, &e, sizeof e);
  }
  return out;
}
inline float hsum(V16 a) {   // pairwise, halving: vector adds, not 16 dependent scalar ones
  for (int width = 8; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) a.v[i] += a.v[i + width];
  return a.v[0];
}
inline float hmax(V16 a) {
  float m = a.v[0];
  for (int i = 1; i < 16; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
// A whole chunk is one loop without a bound per lane, which the compiler makes vector loads and stores
// (with the bound it reads lane by lane: cache_attention's decode step was 1.5x slower on AVX2).
template <typename T>
inline V16 vload(const T* p, int n = 16) {
  V16 r;
  if (n >= 16) {
    for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
  } else {
    for (int i = 0; i < 16; ++i) r.v[i] = i < n ? static_cast<float>(p[i]) : 0.0f;
  }
  return r;
}
template <typename T>
inline void vstore(T* p, V16 a, int n = 16) {
  if (n >= 16) {
    for (int i = 0; i < 16; ++i) p[i] = static_cast<T>(a.v[i]);
  } else {
    for (int i = 0; i < n; ++i) p[i] = static_cast<T>(a.v[i]);
  }
}
#undef XLAUNCH_LLM_EACH

#endif

// The value a float takes once stored as T and read back (the rounding of an intermediate to T).
template <typename T>
inline V16 round_to(V16 a) {
  alignas(64) T tmp[16];
  vstore(tmp, a);
  return vload(tmp);
}
template <>
inline V16 round_to<float>(V16 a) { return a; }

}  // namespace xlaunch_llm
