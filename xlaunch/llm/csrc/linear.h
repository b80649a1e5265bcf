// Packed linear layers of xlaunch.llm (xlaunch/llm/linear/layouts.py packs the weights, these kernels read them).
//
// Weights are cut into blocks of kBlock = 64 output channels (the last block zero-padded); inside a block
// the weights of one step along K lie together, so one pass over a block streams one contiguous range:
//   bf16: [N/64][K/2][64][2]  bf16 pairs (k, k+1) of each output, as vdpbf16ps reads them (K padded to even)
//   int8: [N/64][K/4][64][4]  int8, each output's four steps of K in one 32-bit word, as vpdpbusd and
//         vpmaddubsw read them (K padded to a multiple of 4 with zeros); symmetric per output channel,
//         fp32 scales [N/64][64]
//   int4: [N/64][K/4][4][16][2] bytes; byte (16 * j + i) * 2 + t of step k holds u[n][k + t] in its low
//         nibble and u[n][k + 2 + t] in its high one, n = 64 * block + 16 * j + i, u = q + 8 in [0, 15];
//         fp32 scales [N/64][K/group][64]
//   int6: [N/64][K/4][192] bytes: per step, the int4 layout's 128 bytes of low nibbles (u & 15), then 64 bytes
//         of high bits (u >> 4): byte p holds those of nibble byte p's two values (bits 0-1: its low nibble's,
//         bits 2-3: its high nibble's) in its low nibble and those of nibble byte p + 64 in its high nibble;
//         u = q + 32 in [0, 63]; fp32 scales [N/64][K/group][64] (linear_layout.h: nibble_value)
// Every kernel accumulates in fp32; y = x @ W.T (* scale) + bias, in the activations' dtype.
#pragma once

#include "linear_layout.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace xlaunch_llm {


inline float bf16_bits_to_float(uint16_t half) {
  const uint32_t bits = uint32_t(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays a quiet NaN.
inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// The fp32 sums of rows [m0, m0 + rows) against one block: acc[r * kBlock + c], c < kBlock.
void bf16_block(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t k_pairs, float* acc);
// The same with fp32 rows (zero past K up to 2 * k_pairs), not rounded to bf16: fp32 layers whose weights are
// bf16 values, stored as bf16.
void bf16_f32_block(const float* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t k_pairs, float* acc);
// fp32 weights as ATen keeps them ([N, K] contiguous, no packing): out[r * ldo + c] = x[r] . w[c] for the
// channels [c0, c1) and rows [0, rows) of x ([rows][k]). A few rows only (decode): ATen's GEMV runs on one thread.
void fp32_rows(const float* x, int64_t rows, int64_t k, const float* w, int64_t c0, int64_t c1, float* out,
               int64_t ldo);
// INT8 and INT4 with the activations as they are: the baseline level's kernels (every other level runs
// int8q_block and int4q_block below). int4 applies its group scales itself: group_sums[r * groups + g] =
// sum of row r's (bf16) x over group g.
void int8_block(const float* x, int64_t ldx, int64_t rows, const int8_t* w, int64_t k, float* acc);
void int4_block(const uint16_t* x, int64_t ldx, int64_t rows, const uint8_t* w, const float* scales,
                const float* group_sums, int64_t groups, int64_t group_size, float* acc, int bits = 4);

// Integer dot products (the AVX2 and AVX-512 VNNI paths, as llama.cpp's Q8_0/Q4_0 there): the INT8 and INT4
// kernels take activations quantized per row in blocks of kQuantBlock values, d = max|x| / 127,
// q = round(x / d) (half to even), so y is exact for the rounded activations, not for x. kQuantBlock when
// this build's kernels do that, 0 when they take the activations as they are (exact up to fp32 rounding).
int64_t quantized_activation_block();

// Throws unless packed is a weight of dtype type (bf16, int8 or uint8 for int4 and int6) laid out as above for
// an [n, k] layer (group_size: int4's and int6's group; bits: 6 for int6), with its float32 scales for the
// quantized kinds; op names the caller.
void check_packed(const char* op, const at::Tensor& packed, at::ScalarType type, const at::Tensor* scales,
                  int64_t n, int64_t k, int64_t group_size, int bits = 4);
// Rows [rows][k] of fp32 x -> q [rows][ldq] (zero past k; ldq a multiple of kQuantBlock), d [rows][ldq / 32],
// qsum [rows][ldq / 32] (the sum of each block's q).
void quantize_activations(const float* x, int64_t ldx, int64_t rows, int64_t k, int8_t* q, int64_t ldq, float* d,
                          int32_t* qsum);
// acc[r * kBlock + c] = sum over blocks b of d[r][b] * (sum_k q[r][k] w[k][c]) (int8 block [K/4][64][4]); qsum as
// quantize_activations writes it.
void int8q_block(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, int64_t rows, const int8_t* w,
                 int64_t k, float* acc);
// acc[r * kBlock + c] = sum over groups g of scale[g][c] * sum_b d[r][b] * sum_k q[r][k] (u[k][c] - 8); with
// bits 6 an int6 block, u - 32. (int4_block's bits likewise.)
void int4q_block(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, int64_t rows, const uint8_t* w,
                 const float* scales, int64_t groups, int64_t group_size, float* acc, int bits = 4);

}  // namespace xlaunch_llm
