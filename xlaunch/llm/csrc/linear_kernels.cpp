// The inner loops of xlaunch.llm's packed linear layers: one block of 64 output channels against up to
// kRowTile activation rows. Chosen at compile time (the library is built once per ISA level): bf16 by
// vdpbf16ps, AVX-512F or AVX2 + FMA widening, or plain C++; INT8/INT4/INT6 by AVX-512 VNNI (int_dot_avx512.h),
// AVX2 or plain C++.
#include "linear.h"

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "int_dot_avx512.h"
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace xlaunch_llm {
namespace {

inline int32_t load_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline int16_t load_int16(const int8_t* p) {   // two int8 values as one 16-bit word
  int16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The plain C++ bf16 kernel, for bf16 rows (the baseline level) or fp32 ones (fp32 layers of bf16 values).
inline float as_float(uint16_t bf16_bits) { return bf16_bits_to_float(bf16_bits); }
inline float as_float(float value) { return value; }

template <int R, typename X>
void bf16_tile_plain(const X* x, int64_t ldx, const uint16_t* w, int64_t k_pairs, float* out) {
  float acc[R][kBlock] = {};
  for (int64_t kp = 0; kp < k_pairs; ++kp)
    for (int r = 0; r < R; ++r) {
      const float xe = as_float(x[r * ldx + 2 * kp]), xo = as_float(x[r * ldx + 2 * kp + 1]);
      for (int64_t c = 0; c < kBlock; ++c)
        acc[r][c] += bf16_bits_to_float(w[(kp * kBlock + c) * 2]) * xe + bf16_bits_to_float(w[(kp * kBlock + c) * 2 + 1]) * xo;
    }
  std::memcpy(out, acc, sizeof acc);
}

#if defined(__AVX2__) && defined(__FMA__)

// Without vdpbf16ps (and at every level for fp32 activations, which vdpbf16ps would round to bf16) a bf16
// pair (k, k+1) in a 32-bit lane widens to two fp32 by a shift (k) and a mask (k + 1), then FMA: 8 channels
// a vector with AVX2, 16 with AVX-512F (the avx512 and avx512_vnni levels: Skylake-SP, Cascade Lake, Ice Lake).
struct Avx2Lanes {
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static I load_bits(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F even(I v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static F odd(I v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u)))); }
  static F broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static constexpr int vectors(int rows) { return rows == 1 ? 8 : rows == 2 ? 4 : 2; }   // 16 registers
};

#if defined(__AVX512F__)
struct Avx512Lanes {
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static I load_bits(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static F even(I v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
  static F odd(I v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u)))); }
  static F broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static constexpr int vectors(int rows) { return rows <= 2 ? 4 : 2; }   // 32 registers: 64 channels for 1-2 rows
};
using Bf16Lanes = Avx512Lanes;
#else
using Bf16Lanes = Avx2Lanes;
#endif

// One pass over the pairs [kp0, kp1) for R rows (fp32, widened once per tile) and C vectors of L::kLanes
// channels from channel c0: R * C accumulators (at least 4 for one row, so that the FMA latency is hidden),
// added to out unless first. Each weight vector is widened once per pass and serves every row; a row's pair of
// activations is two broadcasts from memory. Each pass asks for its own channels' bytes Ahead bytes on (the
// next chunk's, when a tile takes several passes), so the weights arrive while all the passes compute, not
// only the first. (A 2-D accumulator array was kept in registers and also stored to the stack every step by
// GCC 12; the flat one with unrolled loops is not.)
template <class L, int R, int C, int64_t Ahead>
void bf16_pass(const float* x, int64_t ldx, const uint16_t* w, int64_t kp0, int64_t kp1, int c0, float* out,
               bool first) {
  typename L::F acc[R * C];
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) acc[i] = L::zero();
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    const uint16_t* wp = w + kp * 2 * kBlock + 2 * c0;
#pragma GCC unroll 8
    for (int line = 0; line < C * L::kLanes * 4; line += 64)   // the pass's channels: C * kLanes pairs of bf16
      _mm_prefetch(reinterpret_cast<const char*>(wp) + Ahead + line, _MM_HINT_T0);
    typename L::F e[C], o[C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      const typename L::I v = L::load_bits(wp + 2 * L::kLanes * j);
      e[j] = L::even(v);
      o[j] = L::odd(v);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const typename L::F xe = L::broadcast(x + r * ldx + 2 * kp), xo = L::broadcast(x + r * ldx + 2 * kp + 1);
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[r * C + j] = L::fma(o[j], xo, L::fma(e[j], xe, acc[r * C + j]));
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) {
    float* at = out + (i / C) * kBlock + c0 + L::kLanes * (i % C);
    L::store(at, first ? acc[i] : L::add(acc[i], L::load(at)));
  }
}

// Pairs of K per chunk when a tile takes several passes (two rows or more): 64 steps of a block's 256 bytes,
// 16 KiB, in L1 for every pass over it. Passes over the whole of K (before) each read one line of every
// four from memory, and the weights came in only as fast as one pass asked: on the AVX2 VM (1 thread,
// 8192 x 2048) 4 rows took 12.7 ms against 3.8 for one row, 2 rows 7.1.
constexpr int64_t kPassChunkPairs = 64;

// R fp32 rows (ldx apart, zero past K up to 2 * k_pairs) against one bf16 block, by the passes above.
template <int R>
void widened_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t k_pairs, float* out) {
  using L = Bf16Lanes;
  constexpr int C = L::vectors(R);
  if (L::kLanes * C == kBlock) {   // one pass over K
    bf16_pass<L, R, C, kPrefetchBytes>(x, ldx, w, 0, k_pairs, 0, out, true);
    return;
  }
  for (int64_t kp0 = 0; kp0 < k_pairs || kp0 == 0; kp0 += kPassChunkPairs) {
    const int64_t kp1 = std::min(k_pairs, kp0 + kPassChunkPairs);
    for (int c0 = 0; c0 < kBlock; c0 += L::kLanes * C)
      bf16_pass<L, R, C, kPassChunkPairs * 2 * kBlock * sizeof(uint16_t)>(x, ldx, w, kp0, kp1, c0, out, kp0 == 0);
  }
}

#endif

// The bf16 kernels: vdpbf16ps, AVX-512F or AVX2 + FMA widening, or plain C++.
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

#elif defined(__AVX2__) && defined(__FMA__)

// The tile's bf16 rows widened to fp32 once (a broadcast from fp32 memory is one instruction; from a
// bf16 value it is four, and with several rows those outnumbered the FMAs: 4 rows cost 3.5x one).
template <int R>
void bf16_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k_pairs, float* out) {
  const int64_t k = 2 * k_pairs;
  thread_local std::vector<float> rows;
  rows.resize(size_t(R) * k);
  for (int r = 0; r < R; ++r) {
    const uint16_t* src = x + r * ldx;
    float* dst = rows.data() + r * k;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 16)));
    for (; i < k; ++i) dst[i] = bf16_bits_to_float(src[i]);
  }
  widened_tile<R>(rows.data(), k, w, k_pairs, out);
}

#else

template <int R>
void bf16_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k_pairs, float* out) {
  bf16_tile_plain<R>(x, ldx, w, k_pairs, out);
}

#endif

// fp32 activations against bf16 weights, not rounded: the widening passes at every SIMD level (vdpbf16ps would
// round them), so a bf16-valued fp32 weight stored as bf16 gives the products fp32 weights give.
template <int R>
void bf16_f32_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t k_pairs, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  widened_tile<R>(x, ldx, w, k_pairs, out);
#else
  bf16_tile_plain<R>(x, ldx, w, k_pairs, out);
#endif
}

// The integer kernels (INT8/INT4 over quantized activations, linear.h: kQuantBlock): AVX-512 VNNI
// (int_dot_avx512.h, at the avx512_vnni level and above) or AVX2; the baseline level has none.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define XLAUNCH_LLM_INT_DOT 1
#define XLAUNCH_LLM_INT_DOT_ROWS 4
using int_dot_avx512::int4q_tile;
using int_dot_avx512::int8q_tile;
#elif defined(__AVX2__) && defined(__FMA__)
#define XLAUNCH_LLM_INT_DOT 1
#define XLAUNCH_LLM_INT_DOT_ROWS 2   // four rows' accumulators would not fit AVX2's 16 registers

// INT8 x quantized activations, llama.cpp's AVX2 Q8_0 dot product: |x| (unsigned) times w with x's sign
// (vpsignb), vpmaddubsw (two products, at most 2 * 127 * 127: no saturation), vpmaddwd into int32; each
// block of kQuantBlock k scaled by its d into fp32. The layout holds each channel's four steps of K in one
// 32-bit word, so a load of 32 bytes is 8 channels ready for the four activations broadcast to every word.
// R <= 2 rows, 32 channels a pass.
template <int R>
void int8q_tile(const int8_t* q, const float* d, const int32_t*, int64_t ldq, const int8_t* w, int64_t k, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t steps = (k + 3) / 4, blocks = (k + kQuantBlock - 1) / kQuantBlock, ldb = ldq / kQuantBlock;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kBlock; c += 8) _mm256_storeu_ps(out + r * kBlock + c, _mm256_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t s0 = b * (kQuantBlock / 4), s1 = std::min(steps, s0 + kQuantBlock / 4);
    prefetch_ahead(w + s0 * 4 * kBlock, kQuantBlock * kBlock);
    for (int64_t c0 = 0; c0 < kBlock; c0 += 32) {
      __m256i acc[R][4];   // int32, channels c0 + 8j + i
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_si256();
      for (int64_t step = s0; step < s1; ++step) {
        const int8_t* wp = w + step * 4 * kBlock + 4 * c0;
        __m256i wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * j));
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_set1_epi32(load_four(q + r * ldq + 4 * step));
          const __m256i ax = _mm256_sign_epi8(xv, xv);
          for (int j = 0; j < 4; ++j)
            acc[r][j] = _mm256_add_epi32(acc[r][j],
                _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[j], xv)), ones));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_set1_ps(d[r * ldb + b]);
        float* o = out + r * kBlock + c0;
        for (int j = 0; j < 4; ++j)
          _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][j]), scale, _mm256_loadu_ps(o + 8 * j)));
      }
    }
  }
}

// INT4 x quantized activations (llama.cpp's AVX2 Q4_0 dot product): the nibbles u = q + 8 in [0, 15] are the
// unsigned side of vpmaddubsw, with the activation pair (k, k+1) or (k+2, k+3) as the signed side; four
// steps of K sum in int16 (at most 4 * 4 * 15 * 127 = 30480), then widen to int32. Per block of kQuantBlock,
// (sum u q - 8 sum q) * d * scale[group][c]. R <= 2 rows, 32 channels a pass. Bits 6: an int6 block, each
// value's top two bits from the step's high-bit bytes (linear.h), u = q + 32 in [0, 63]; four products of
// one step reach 4 * 63 * 127 = 32004, so the int16 sums widen to int32 every step, not every four.
template <int R, int Bits = 4>
void int4q_tile(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, const uint8_t* w,
                const float* scales, int64_t group_size, int64_t k, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  const int64_t blocks = k / kQuantBlock, ldb = ldq / kQuantBlock;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kBlock; c += 8) _mm256_storeu_ps(out + r * kBlock + c, _mm256_setzero_ps());
  const int64_t per_group = group_size / kQuantBlock;   // group_size is a multiple of kQuantBlock here
  const float* sg = scales;
  constexpr int64_t step_bytes = nibble_step_bytes(Bits), int16_steps = Bits == 4 ? 4 : 1;
  for (int64_t b = 0, in_group = 0; b < blocks; ++b) {
    prefetch_ahead(w + b * (kQuantBlock / 4) * step_bytes, kQuantBlock / 4 * step_bytes);
    for (int64_t c0 = 0; c0 < kBlock; c0 += 32) {
      __m256i acc[R][4];   // int32, channels c0 + 8i
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_si256();
      for (int64_t k4 = 0; k4 < kQuantBlock; k4 += 4 * int16_steps) {
        __m256i part[R][2];   // int16, channels c0 + 16j + i
        for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_si256();
        for (int64_t t = 0; t < 4 * int16_steps; t += 4) {
          const int64_t kk = b * kQuantBlock + k4 + t;
          const uint8_t* step = w + (kk / 4) * step_bytes;
          const uint8_t* wp = step + 2 * c0;
          __m256i lo[2], hi[2];
          for (int j = 0; j < 2; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * j));
            lo[j] = _mm256_and_si256(v, low);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if constexpr (Bits == 6) {   // nibble bytes 2 c0 + 32 j: high-bit bytes 32 j, nibble c0 / 32 of each
              const __m256i top = _mm256_set1_epi8(0x30);
              const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 2 * kBlock + 32 * j));
              const __m256i g = c0 == 0 ? h : _mm256_srli_epi16(h, 4);
              lo[j] = _mm256_or_si256(lo[j], _mm256_and_si256(_mm256_slli_epi16(g, 4), top));
              hi[j] = _mm256_or_si256(hi[j], _mm256_and_si256(_mm256_slli_epi16(g, 2), top));
            }
          }
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = q + r * ldq + kk;
            const __m256i x01 = _mm256_set1_epi16(load_int16(xr)), x23 = _mm256_set1_epi16(load_int16(xr + 2));
            for (int j = 0; j < 2; ++j)
              part[r][j] = _mm256_add_epi16(part[r][j], _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], x01),
                                                                         _mm256_maddubs_epi16(hi[j], x23)));
          }
        }
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 2; ++j) {
            acc[r][2 * j] = _mm256_add_epi32(acc[r][2 * j], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(part[r][j])));
            acc[r][2 * j + 1] = _mm256_add_epi32(acc[r][2 * j + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(part[r][j], 1)));
          }
      }
      for (int r = 0; r < R; ++r) {
        const __m256i offset = _mm256_set1_epi32((1 << (Bits - 1)) * qsum[r * ldb + b]);
        const __m256 scale = _mm256_set1_ps(d[r * ldb + b]);
        float* o = out + r * kBlock + c0;
        for (int i = 0; i < 4; ++i) {
          const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][i], offset));
          _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_mul_ps(v, scale), _mm256_loadu_ps(sg + c0 + 8 * i),
                                                      _mm256_loadu_ps(o + 8 * i)));
        }
      }
    }
    if (++in_group == per_group) in_group = 0, sg += kBlock;
  }
}

#endif

// The INT8/INT4 kernels of the baseline level, where activations are taken as they are (fp32 for INT8,
// bf16 for INT4); every other level runs the integer kernels (int8q_block, int4q_block) instead.
template <int R>
void int8_tile(const float* x, int64_t ldx, const int8_t* w, int64_t k, float* out) {
  float acc[R][kBlock] = {};
  for (int64_t kk = 0; kk < k; ++kk)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kBlock; ++c) acc[r][c] += float(w[int8_offset(kk, c)]) * x[r * ldx + kk];
  std::memcpy(out, acc, sizeof acc);
}

template <int R, int Bits>
void int4_tile(const uint16_t* x, int64_t ldx, const uint8_t* w, const float* scales, const float* sums,
               int64_t groups, int64_t group_size, float* out) {
  float acc[R][kBlock] = {};
  const int64_t quads = group_size / 4, zero = 1 << (Bits - 1);
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kBlock; ++c) {
        float part = 0.0f;
        for (int64_t q = 0; q < quads; ++q) {
          const int64_t k = (g * quads + q) * 4;
          const uint8_t* step = w + (g * quads + q) * nibble_step_bytes(Bits);
          for (int t = 0; t < 4; ++t)
            part += float(nibble_value<Bits>(step, c, t) - zero) * bf16_bits_to_float(x[r * ldx + k + t]);
        }
        acc[r][c] += part * scales[g * kBlock + c];
      }
  (void)sums;
  std::memcpy(out, acc, sizeof acc);
}

}  // namespace

int64_t quantized_activation_block() {
#if defined(XLAUNCH_LLM_INT_DOT)
  return kQuantBlock;
#else
  return 0;
#endif
}

void quantize_activations(const float* x, int64_t ldx, int64_t rows, int64_t k, int8_t* q, int64_t ldq, float* d,
                          int32_t* qsum) {
  const int64_t blocks = ldq / kQuantBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k0 = b * kQuantBlock, k1 = std::min(k, k0 + kQuantBlock);
#if defined(XLAUNCH_LLM_INT_DOT)
      if (k1 - k0 == kQuantBlock) {   // a full block in vectors: the same values as the loop below
        const float* xb = x + r * ldx + k0;
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(xb + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        __m256i n[4];   // round half to even: the rounding mode nearbyint uses
        for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
        const __m256i words = _mm256_packs_epi32(n[0], n[1]), words2 = _mm256_packs_epi32(n[2], n[3]);
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * ldq + k0), bytes);
        __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
        d[r * blocks + b] = top / 127.0f;
        qsum[r * blocks + b] = _mm_cvtsi128_si32(t4);
        continue;
      }
#endif
      float amax = 0.0f;
      for (int64_t kk = k0; kk < k1; ++kk) amax = std::max(amax, std::fabs(x[r * ldx + kk]));
      const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int64_t kk = k0; kk < k0 + kQuantBlock; ++kk) {
        const int8_t v = kk < k1 ? int8_t(std::nearbyint(x[r * ldx + kk] * inverse)) : int8_t(0);
        q[r * ldq + kk] = v;
        sum += v;
      }
      d[r * blocks + b] = scale;
      qsum[r * blocks + b] = sum;
    }
}

// fp32 rows against fp32 weights in ATen's layout: per channel, R <= 4 dot products over one pass of its K
// weights, two AVX2 accumulators a row (memory-bound: a 256-bit load is enough at every SIMD level).
template <int R>
void fp32_channel(const float* x, int64_t k, const float* wc, float* out, int64_t ldo) {
  int64_t i = 0;
  float sum[R];
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m256 w0 = _mm256_loadu_ps(wc + i), w1 = _mm256_loadu_ps(wc + i + 8);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + i), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + i + 8), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 v = _mm256_add_ps(acc[r][0], acc[r][1]);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum[r] = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
#else
  for (int r = 0; r < R; ++r) sum[r] = 0.0f;
#endif
  for (; i < k; ++i)
    for (int r = 0; r < R; ++r) sum[r] += wc[i] * x[r * k + i];
  for (int r = 0; r < R; ++r) out[r * ldo] = sum[r];
}

#define XLAUNCH_LLM_ROWS(CALL) \
  switch (rows) {              \
    case 1: CALL(1); break;    \
    case 2: CALL(2); break;    \
    case 3: CALL(3); break;    \
    default: CALL(4); break;   \
  }

void fp32_rows(const float* x, int64_t rows, int64_t k, const float* w, int64_t c0, int64_t c1, float* out,
               int64_t ldo) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4)
    for (int64_t c = c0; c < c1; ++c) {
      const float* xr = x + r0 * k;
      float* o = out + r0 * ldo + c;
      switch (std::min<int64_t>(4, rows - r0)) {
        case 1: fp32_channel<1>(xr, k, w + c * k, o, ldo); break;
        case 2: fp32_channel<2>(xr, k, w + c * k, o, ldo); break;
        case 3: fp32_channel<3>(xr, k, w + c * k, o, ldo); break;
        default: fp32_channel<4>(xr, k, w + c * k, o, ldo); break;
      }
    }
}

void bf16_block(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t k_pairs, float* acc) {
#define CALL(R) bf16_tile<R>(x, ldx, w, k_pairs, acc)
  XLAUNCH_LLM_ROWS(CALL)
#undef CALL
}

void bf16_f32_block(const float* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t k_pairs, float* acc) {
#define CALL(R) bf16_f32_tile<R>(x, ldx, w, k_pairs, acc)
  XLAUNCH_LLM_ROWS(CALL)
#undef CALL
}

void int8_block(const float* x, int64_t ldx, int64_t rows, const int8_t* w, int64_t k, float* acc) {
#define CALL(R) int8_tile<R>(x, ldx, w, k, acc)
  XLAUNCH_LLM_ROWS(CALL)
#undef CALL
}

void int4_block(const uint16_t* x, int64_t ldx, int64_t rows, const uint8_t* w, const float* scales,
                const float* group_sums, int64_t groups, int64_t group_size, float* acc, int bits) {
#define CALL(R)                                                                                 \
  bits == 6 ? int4_tile<R, 6>(x, ldx, w, scales, group_sums, groups, group_size, acc)        \
            : int4_tile<R, 4>(x, ldx, w, scales, group_sums, groups, group_size, acc)
  XLAUNCH_LLM_ROWS(CALL)
#undef CALL
}

#if defined(XLAUNCH_LLM_INT_DOT)
// Up to XLAUNCH_LLM_INT_DOT_ROWS rows a pass over the block (the registers the accumulators take).
#define XLAUNCH_LLM_INT_ROWS(CALL)                                        \
  for (int64_t r = 0; r < rows;) {                                         \
    const int64_t n = std::min<int64_t>(rows - r, XLAUNCH_LLM_INT_DOT_ROWS); \
    switch (n) {                                                           \
      case 1: CALL(1); break;                                              \
      case 2: CALL(2); break;                                              \
      case 3: CALL(3); break;                                              \
      default: CALL(4); break;                                             \
    }                                                                      \
    r += n;                                                                \
  }

void int8q_block(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, int64_t rows, const int8_t* w,
                 int64_t k, float* acc) {
  const int64_t ldd = ldq / kQuantBlock;
#define CALL(R) int8q_tile<R>(q + r * ldq, d + r * ldd, qsum + r * ldd, ldq, w, k, acc + r * kBlock)
  XLAUNCH_LLM_INT_ROWS(CALL)
#undef CALL
}

void int4q_block(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, int64_t rows, const uint8_t* w,
                 const float* scales, int64_t groups, int64_t group_size, float* acc, int bits) {
  const int64_t ldd = ldq / kQuantBlock, k = groups * group_size;
#define CALL(R)                                                                                                     \
  bits == 6 ? int4q_tile<R, 6>(q + r * ldq, d + r * ldd, qsum + r * ldd, ldq, w, scales, group_size, k, acc + r * kBlock) \
            : int4q_tile<R, 4>(q + r * ldq, d + r * ldd, qsum + r * ldd, ldq, w, scales, group_size, k, acc + r * kBlock)
  XLAUNCH_LLM_INT_ROWS(CALL)
#undef CALL
}

#else

// The baseline level has no integer kernels: its INT8/INT4/INT6 layers take the activations as they are
// (quantized_activation_block() is 0, and linear.cpp never calls these there).
void int8q_block(const int8_t*, const float*, const int32_t*, int64_t, int64_t, const int8_t*, int64_t, float*) {
  TORCH_CHECK(false, "xlaunch_llm: this build's level has no integer kernels (quantized activations)");
}

void int4q_block(const int8_t*, const float*, const int32_t*, int64_t, int64_t, const uint8_t*, const float*, int64_t,
                 int64_t, float*, int) {
  TORCH_CHECK(false, "xlaunch_llm: this build's level has no integer kernels (quantized activations)");
}

#endif

}  // namespace xlaunch_llm
