// Packed linear layers of xlaunch.llm (xlaunch/llm/linear.py packs the weights, these kernels read them).
//
// Weights are cut into blocks of kBlock = 64 output channels (the last block zero-padded); inside a block
// the weights of one step along K lie together, so one pass over a block streams one contiguous range:
//   bf16: [N/64][K/2][64][2]  bf16 pairs (k, k+1) of each output, as vdpbf16ps reads them (K padded to even)
//   int8: [N/64][K][64]       int8, symmetric per output channel, fp32 scales [N/64][64]
//   int4: [N/64][K/4][4][16][2] bytes; byte (16 * j + i) * 2 + t of step k holds u[n][k + t] in its low
//         nibble and u[n][k + 2 + t] in its high one, n = 64 * block + 16 * j + i, u = q + 8 in [0, 15];
//         fp32 scales [N/64][K/group][64]
// Every kernel accumulates in fp32; y = x @ W.T (* scale) + bias, in the activations' dtype.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace xlaunch_llm {

constexpr int64_t kBlock = 64;    // output channels per packed block
constexpr int64_t kRowTile = 4;   // activation rows one pass over a block serves

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
void int8_block(const float* x, int64_t ldx, int64_t rows, const int8_t* w, int64_t k, float* acc);
// int4 applies its group scales itself: group_sums[r * groups + g] = sum of row r's (bf16) x over group g.
void int4_block(const uint16_t* x, int64_t ldx, int64_t rows, const uint8_t* w, const float* scales,
                const float* group_sums, int64_t groups, int64_t group_size, float* acc);

}  // namespace xlaunch_llm
