// Shared helpers of xlaunch.nn's kernels: bf16 <-> fp32 bit moves and the split-bf16 master layout
// (xlaunch/kernels/optim/splitbf16.py: the bf16 weight is the high half of the fp32 master, an
// int16 "trail" tensor holds the low half; joining them is exact, splitting truncates).
#pragma once

#include <cstdint>
#include <cstring>

namespace xlaunch_nn {

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float bf16_to_float(uint16_t half) { return bits_to_float(uint32_t(half) << 16); }

// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays a quiet NaN.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits = float_to_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// The fp32 master whose halves are (top, trail), and back.
inline float join_master(uint16_t top, uint16_t trail) {
  return bits_to_float((uint32_t(top) << 16) | uint32_t(trail));
}

inline void split_master(float master, uint16_t* top, uint16_t* trail) {
  const uint32_t bits = float_to_bits(master);
  *top = uint16_t(bits >> 16);
  *trail = uint16_t(bits & 0xffffu);
}

// Element loads and stores that read fp32 and bf16 storage alike (bf16 as its uint16 bits).
inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_float(*p); }
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = float_to_bf16(v); }

}  // namespace xlaunch_nn
