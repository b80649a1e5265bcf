// The inner loops of xlaunch.llm's packed linear layers: one block of 64 output channels against up to
// kRowTile activation rows. Chosen at compile time (the library is built with -march=native):
// AVX512_BF16 (vdpbf16ps), AVX2 + FMA, or plain C++.
#include "linear.h"

#include <immintrin.h>

namespace xlaunch_llm {
namespace {

inline int32_t load_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)

template <int R>
void bf16_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k_pairs, float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    const uint16_t* wp = w + kp * 2 * kBlock;
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(load_pair(x + r * ldx + 2 * kp));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kBlock + 16 * j, acc[r][j]);
}

template <int R>
void int8_tile(const float* x, int64_t ldx, const int8_t* w, int64_t k, float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const int8_t* wp = w + kk * kBlock;
    __m512 wv[4];
    for (int j = 0; j < 4; ++j)
      wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16 * j))));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + kk]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kBlock + 16 * j, acc[r][j]);
}

// u | 0x4300 is the bf16 of 128 + u (u < 128), so the products sum (128 + u) x = sum q x + 136 sum x.
template <int R>
void int4_tile(const uint16_t* x, int64_t ldx, const uint8_t* w, const float* scales, const float* sums,
               int64_t groups, int64_t group_size, float* out) {
  const __m512i low = _mm512_set1_epi16(0x000f), magic = _mm512_set1_epi16(0x4300);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t quads = group_size / 4;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) part[r][j] = _mm512_setzero_ps();
    for (int64_t q = 0; q < quads; ++q) {
      const int64_t k = (g * quads + q) * 4;
      const uint8_t* wp = w + (g * quads + q) * 2 * kBlock;
      __m512bh lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * j)));
        lo[j] = (__m512bh)_mm512_ternarylogic_epi32(b, low, magic, 0xEA);   // (b & low) | magic
        hi[j] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), magic);
      }
      for (int r = 0; r < R; ++r) {
        const __m512bh x01 = (__m512bh)_mm512_set1_epi32(load_pair(x + r * ldx + k));
        const __m512bh x23 = (__m512bh)_mm512_set1_epi32(load_pair(x + r * ldx + k + 2));
        for (int j = 0; j < 4; ++j) {
          part[r][j] = _mm512_dpbf16_ps(part[r][j], lo[j], x01);
          part[r][j] = _mm512_dpbf16_ps(part[r][j], hi[j], x23);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 offset = _mm512_set1_ps(136.0f * sums[r * groups + g]);
      for (int j = 0; j < 4; ++j)
        acc[r][j] = _mm512_fmadd_ps(_mm512_sub_ps(part[r][j], offset),
                                    _mm512_loadu_ps(scales + g * kBlock + 16 * j), acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kBlock + 16 * j, acc[r][j]);
}

#elif defined(__AVX2__) && defined(__FMA__)

// AVX2: a block is read as four slices of 16 channels; a bf16 pair (k, k+1) in a 32-bit lane widens to
// two fp32 by a shift (k) and a mask (k + 1).
inline __m256 even_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_half(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u)))); }

template <int R>
void bf16_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k_pairs, float* out) {
  for (int s = 0; s < 4; ++s) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < k_pairs; ++kp) {
      const uint16_t* wp = w + kp * 2 * kBlock + 32 * s;
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16));
      const __m256 e0 = even_half(w0), o0 = odd_half(w0), e1 = even_half(w1), o1 = odd_half(w1);
      for (int r = 0; r < R; ++r) {
        const __m256 xe = _mm256_set1_ps(bf16_bits_to_float(x[r * ldx + 2 * kp]));
        const __m256 xo = _mm256_set1_ps(bf16_bits_to_float(x[r * ldx + 2 * kp + 1]));
        acc[r][0] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, acc[r][0]));
        acc[r][1] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, acc[r][1]));
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * kBlock + 16 * s, acc[r][0]);
      _mm256_storeu_ps(out + r * kBlock + 16 * s + 8, acc[r][1]);
    }
  }
}

template <int R>
void int8_tile(const float* x, int64_t ldx, const int8_t* w, int64_t k, float* out) {
  for (int s = 0; s < 4; ++s) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
      const int8_t* wp = w + kk * kBlock + 16 * s;
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[r * ldx + kk]);
        acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * kBlock + 16 * s, acc[r][0]);
      _mm256_storeu_ps(out + r * kBlock + 16 * s + 8, acc[r][1]);
    }
  }
}

template <int R>
void int4_tile(const uint16_t* x, int64_t ldx, const uint8_t* w, const float* scales, const float* sums,
               int64_t groups, int64_t group_size, float* out) {
  const __m256i low = _mm256_set1_epi16(0x000f), magic = _mm256_set1_epi16(0x4300);
  const int64_t quads = group_size / 4;
  for (int s = 0; s < 8; ++s) {   // eight slices of 8 channels
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
      for (int64_t q = 0; q < quads; ++q) {
        const int64_t k = (g * quads + q) * 4;
        const uint8_t* wp = w + (g * quads + q) * 2 * kBlock + 16 * s;
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(b, low), magic);
        const __m256i hi = _mm256_or_si256(_mm256_srli_epi16(b, 4), magic);
        const __m256 w0 = even_half(lo), w1 = odd_half(lo), w2 = even_half(hi), w3 = odd_half(hi);
        for (int r = 0; r < R; ++r) {
          const uint16_t* xr = x + r * ldx + k;
          part[r] = _mm256_fmadd_ps(w0, _mm256_set1_ps(bf16_bits_to_float(xr[0])), part[r]);
          part[r] = _mm256_fmadd_ps(w1, _mm256_set1_ps(bf16_bits_to_float(xr[1])), part[r]);
          part[r] = _mm256_fmadd_ps(w2, _mm256_set1_ps(bf16_bits_to_float(xr[2])), part[r]);
          part[r] = _mm256_fmadd_ps(w3, _mm256_set1_ps(bf16_bits_to_float(xr[3])), part[r]);
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_sub_ps(part[r], _mm256_set1_ps(136.0f * sums[r * groups + g])),
                                 _mm256_loadu_ps(scales + g * kBlock + 8 * s), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kBlock + 8 * s, acc[r]);
  }
}

#else

template <int R>
void bf16_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k_pairs, float* out) {
  float acc[R][kBlock] = {};
  for (int64_t kp = 0; kp < k_pairs; ++kp)
    for (int r = 0; r < R; ++r) {
      const float xe = bf16_bits_to_float(x[r * ldx + 2 * kp]), xo = bf16_bits_to_float(x[r * ldx + 2 * kp + 1]);
      for (int64_t c = 0; c < kBlock; ++c)
        acc[r][c] += bf16_bits_to_float(w[(kp * kBlock + c) * 2]) * xe + bf16_bits_to_float(w[(kp * kBlock + c) * 2 + 1]) * xo;
    }
  std::memcpy(out, acc, sizeof acc);
}

template <int R>
void int8_tile(const float* x, int64_t ldx, const int8_t* w, int64_t k, float* out) {
  float acc[R][kBlock] = {};
  for (int64_t kk = 0; kk < k; ++kk)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kBlock; ++c) acc[r][c] += float(w[kk * kBlock + c]) * x[r * ldx + kk];
  std::memcpy(out, acc, sizeof acc);
}

template <int R>
void int4_tile(const uint16_t* x, int64_t ldx, const uint8_t* w, const float* scales, const float* sums,
               int64_t groups, int64_t group_size, float* out) {
  float acc[R][kBlock] = {};
  const int64_t quads = group_size / 4;
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kBlock; ++c) {
        float part = 0.0f;
        for (int64_t q = 0; q < quads; ++q) {
          const int64_t k = (g * quads + q) * 4;
          const uint8_t* wp = w + (g * quads + q) * 2 * kBlock + 2 * c;
          for (int t = 0; t < 2; ++t) {
            part += float(int(wp[t] & 15) - 8) * bf16_bits_to_float(x[r * ldx + k + t]);
            part += float(int(wp[t] >> 4) - 8) * bf16_bits_to_float(x[r * ldx + k + 2 + t]);
          }
        }
        acc[r][c] += part * scales[g * kBlock + c];
      }
  (void)sums;
  std::memcpy(out, acc, sizeof acc);
}

#endif

}  // namespace

#define XLAUNCH_LLM_ROWS(CALL) \
  switch (rows) {              \
    case 1: CALL(1); break;    \
    case 2: CALL(2); break;    \
    case 3: CALL(3); break;    \
    default: CALL(4); break;   \
  }

void bf16_block(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t k_pairs, float* acc) {
#define CALL(R) bf16_tile<R>(x, ldx, w, k_pairs, acc)
  XLAUNCH_LLM_ROWS(CALL)
#undef CALL
}

void int8_block(const float* x, int64_t ldx, int64_t rows, const int8_t* w, int64_t k, float* acc) {
#define CALL(R) int8_tile<R>(x, ldx, w, k, acc)
  XLAUNCH_LLM_ROWS(CALL)
#undef CALL
}

void int4_block(const uint16_t* x, int64_t ldx, int64_t rows, const uint8_t* w, const float* scales,
                const float* group_sums, int64_t groups, int64_t group_size, float* acc) {
#define CALL(R) int4_tile<R>(x, ldx, w, scales, group_sums, groups, group_size, acc)
  XLAUNCH_LLM_ROWS(CALL)
#undef CALL
}

}  // namespace xlaunch_llm
