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
