// The packed layouts' sizes (linear.h describes the layouts) and the helpers every level's kernels share,
// without ATen: the kernels' headers that tests also compile on their own (int_dot_avx512.h) need these
// and nothing else.
#pragma once

#include <xmmintrin.h>   // _mm_prefetch (SSE: every x86-64)

#include <cstdint>
#include <cstring>

namespace xlaunch_llm {

constexpr int64_t kBlock = 64;         // output channels per packed block
constexpr int64_t kRowTile = 4;        // activation rows one pass over a block serves
constexpr int64_t kQuantBlock = 32;    // activation values per quantized block (the integer kernels)

// Bytes of one packed int8 block (linear.h): K rounded up to a multiple of 4, times the block's channels.
constexpr int64_t int8_block_bytes(int64_t k) { return (k + 3) / 4 * 4 * kBlock; }
// Where value (k, c) of a packed int8 block lies: channel c's word of step k / 4, byte k % 4.
constexpr int64_t int8_offset(int64_t k, int64_t c) { return (k / 4) * 4 * kBlock + 4 * c + k % 4; }

// Bytes of one step of four K of a packed int4 block (64 channels x 4 nibbles) and of an int6 one: the same
// 128 nibble bytes followed by 64 bytes of high bits (linear.h).
constexpr int64_t nibble_step_bytes(int bits) { return bits == 6 ? 3 * kBlock : 2 * kBlock; }

// The unsigned value u of channel c's t-th of four K (t < 4) in one step of a packed int4 (u in [0, 15]) or
// int6 (u in [0, 63]) block: nibble byte 2c + t % 2 holds it in its low nibble (t < 2) or high one; for int6,
// high-bit byte p % 64 (p the nibble byte) holds its top two bits, in its low nibble for p < 64, else its high
// one, bits 0-1 for the low nibble's value and bits 2-3 for the high one's.
template <int Bits>
inline int nibble_value(const uint8_t* step, int64_t c, int t) {
  const int64_t p = 2 * c + (t & 1);
  int u = t < 2 ? step[p] & 15 : step[p] >> 4;
  if constexpr (Bits == 6) {
    const int g = (step[2 * kBlock + (p & 63)] >> (p < 64 ? 0 : 4)) & 15;
    u |= ((t < 2 ? g : g >> 2) & 3) << 4;
  }
  return u;
}

// How far ahead of the weights they read the integer kernels ask for the weights' bytes (into L1): a core
// streaming the weights from memory waits on each line otherwise. Measured on a Zen 3 VM, 1 thread: INT4
// decode linears about 15% faster. On the 16-core AMX Xeon (48 layers of 8192 x 2048 streamed from memory,
// 1-16 threads) no prefetch was 10-25% slower; into L2 (prefetcht1), or 16 KiB ahead, within the noise.
constexpr int64_t kPrefetchBytes = 8192;

// Asks for the weights' bytes [p + kPrefetchBytes, p + kPrefetchBytes + bytes). Past the end of the weights
// it reads nothing (a prefetch never faults).
inline void prefetch_ahead(const void* p, int64_t bytes) {
  const char* at = static_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(at + line, _MM_HINT_T0);
}

// A loaded vector kept in one register: a vector that two instructions consume (the INT4 nibbles' low and
// high halves) is otherwise loaded twice, GCC's generic tuning folding the load into each use. Zen 5 VM,
// 1 thread, INT4 weights streamed from memory: the VNNI tile alone 31.5 -> 37.7 GB/s, int4_linear 29.6 ->
// 31.0. Not used at the AVX2 level: with 16 registers GCC folds the load to spare one, and forcing it there
// cost 5-10% (int4_linear, same machine). A no-op where the vector type is not a native register (SIMDe's
// emulation in the tests).
template <typename V>
inline V in_register(V v) {
#if defined(__AVX512F__)
  __asm__("" : "+v"(v));
#endif
  return v;
}

inline int32_t load_four(const int8_t* p) {   // four int8 values as one 32-bit word
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace xlaunch_llm
