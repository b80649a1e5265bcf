// The INT8, INT4 and INT6 layers' integer dot products at the AVX-512 levels with VNNI (vpdpbusd: four u8 x s8
// products summed into each int32 lane, 64 an instruction), as llama.cpp's Q8_0/Q4_0 on such CPUs.
// The activations come quantized per row in blocks of kQuantBlock (linear.h: quantize_activations).
//
// The includer provides the _mm512 intrinsics (<immintrin.h> in the library; SIMDe's portable ones in
// tests/llm/test_int_dot_emulated.py, which runs these kernels on a CPU without AVX-512) and, before this
// header, the constants of linear_layout.h. Up to four rows share each pass over the weights.
#pragma once

#include "linear_layout.h"

#include <algorithm>
#include <cstdint>

namespace xlaunch_llm {
namespace int_dot_avx512 {

// out[r * kBlock + c] = sum over blocks b of d[r][b] * sum_k q[r][k] w[k][c], for an int8 block [K/4][64][4]
// (each channel's four steps of K in one 32-bit word: a 64-byte load is 16 channels, ready for vpdpbusd).
// The weights are flipped to unsigned (w + 128 in [1, 255]: vpdpbusd's unsigned side), and
// sum (w + 128) q = sum w q + 128 qsum: the flip is taken off once per block of K. Per block of K the int32
// sums stay below 32 * 255 * 128.
template <int R>
void int8q_tile(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, const int8_t* w, int64_t k,
                float* out) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const int64_t steps = (k + 3) / 4, blocks = (k + kQuantBlock - 1) / kQuantBlock, ldb = ldq / kQuantBlock;
  for (int i = 0; i < R * kBlock; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());   // fp32 sums
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t s0 = b * (kQuantBlock / 4), s1 = std::min(steps, s0 + kQuantBlock / 4);
    prefetch_ahead(w + s0 * 4 * kBlock, kQuantBlock * kBlock);
    __m512i dot[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) dot[r][j] = _mm512_setzero_si512();
    for (int64_t step = s0; step < s1; ++step) {   // past K the weights are zero (and so are the activations)
      const int8_t* wp = w + step * 4 * kBlock;
      __m512i wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = _mm512_xor_si512(_mm512_loadu_si512(wp + 64 * j), flip);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(load_four(q + r * ldq + 4 * step));
        for (int j = 0; j < 4; ++j) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], wv[j], xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32(128 * qsum[r * ldb + b]);
      const __m512 scale = _mm512_set1_ps(d[r * ldb + b]);
      for (int j = 0; j < 4; ++j) {
        float* at = out + r * kBlock + 16 * j;
        _mm512_storeu_ps(at, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][j], offset)), scale,
                                             _mm512_loadu_ps(at)));
      }
    }
  }
}

// One step of four K of an int4 block (linear.h: channel n's bytes 2n and 2n + 1 hold u[k], u[k+1] in their
// low nibbles and u[k+2], u[k+3] in their high ones), as four vectors whose int32 lanes hold one channel's
// u[k..k+3] in order: for half h (channels 32 h to 32 h + 31), vector 2 h holds channel 32 h + 8 L + i in
// 128-bit lane L, lane i, and vector 2 h + 1 channel 32 h + 8 L + 4 + i. Bits 6: an int6 block's step, whose
// 64 bytes of high bits after the nibbles put each value's top two bits at bits 4-5 (u in [0, 63]): byte p
// of them serves nibble byte p of half 0 in its low nibble and of half 1 in its high one.
template <int Bits = 4>
inline void int4_step(const uint8_t* wp, __m512i out[4]) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512i high = _mm512_setzero_si512();
  if constexpr (Bits == 6) high = in_register(_mm512_loadu_si512(wp + 2 * kBlock));
  for (int h = 0; h < 2; ++h) {
    const __m512i v = in_register(_mm512_loadu_si512(wp + 64 * h));
    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if constexpr (Bits == 6) {
      const __m512i top = _mm512_set1_epi8(0x30);
      const __m512i g = h == 0 ? high : _mm512_srli_epi16(high, 4);   // each byte's bits 0-3: this half's
      lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(g, 4), top));
      hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(g, 2), top));
    }
    out[2 * h] = _mm512_unpacklo_epi16(lo, hi);
    out[2 * h + 1] = _mm512_unpackhi_epi16(lo, hi);
  }
}

// out[r * kBlock + c] = sum over groups g of scale[g][c] * sum_b d[r][b] * sum_k q[r][k] (u[k][c] - 8): the
// nibbles u = q + 8 are the unsigned side, the activations the signed one, and 8 qsum comes off per block.
// group_size is a multiple of kQuantBlock, so is K. Bits 6: an int6 block (u = q + 32, 32 qsum off).
template <int R, int Bits = 4>
void int4q_tile(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, const uint8_t* w,
                const float* scales, int64_t group_size, int64_t k, float* out) {
  const int64_t blocks = k / kQuantBlock, ldb = ldq / kQuantBlock, per_group = group_size / kQuantBlock;
  // The group's scales in int4_step's channel order, from the natural order's vectors of 16.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(4));
  alignas(64) float acc[R * kBlock];   // int4_step's channel order: vector v at 16 v
  for (int i = 0; i < R * kBlock; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
  __m512 sv[4];
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % per_group == 0) {
      const float* sg = scales + (b / per_group) * kBlock;
      for (int h = 0; h < 2; ++h) {
        const __m512 s0 = _mm512_loadu_ps(sg + 32 * h), s1 = _mm512_loadu_ps(sg + 32 * h + 16);
        sv[2 * h] = _mm512_permutex2var_ps(s0, first, s1);
        sv[2 * h + 1] = _mm512_permutex2var_ps(s0, second, s1);
      }
    }
    constexpr int64_t step_bytes = nibble_step_bytes(Bits);
    const uint8_t* wb = w + b * (kQuantBlock / 4) * step_bytes;
    prefetch_ahead(wb, kQuantBlock / 4 * step_bytes);
    __m512i dot[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) dot[r][v] = _mm512_setzero_si512();
    for (int64_t t = 0; t < kQuantBlock; t += 4) {
      __m512i wv[4];
      int4_step<Bits>(wb + (t / 4) * step_bytes, wv);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(load_four(q + r * ldq + b * kQuantBlock + t));
        for (int v = 0; v < 4; ++v) dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], wv[v], xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32((1 << (Bits - 1)) * qsum[r * ldb + b]);
      const __m512 scale = _mm512_set1_ps(d[r * ldb + b]);
      for (int v = 0; v < 4; ++v) {
        float* at = acc + r * kBlock + 16 * v;
        const __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][v], offset)), scale);
        _mm512_store_ps(at, _mm512_fmadd_ps(sum, sv[v], _mm512_load_ps(at)));
      }
    }
  }
  for (int r = 0; r < R; ++r)   // back to channel order
    for (int v = 0; v < 4; ++v)
      for (int lane = 0; lane < 4; ++lane)
        for (int i = 0; i < 4; ++i)
          out[r * kBlock + 32 * (v / 2) + 8 * lane + 4 * (v % 2) + i] = acc[r * kBlock + 16 * v + 4 * lane + i];
}

}  // namespace int_dot_avx512
}  // namespace xlaunch_llm
