// xlaunch.llm's AVX-512 VNNI integer kernels (xlaunch/llm/csrc/int_dot_avx512.h) compiled against SIMDe's
// portable AVX-512 (Debian's libsimde-dev), so that they run and are tested on a CPU without AVX-512.
// test_int_dot_emulated.py builds this file and calls its entry points through ctypes.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

// SIMDe 0.7.4 has no _mm512_cvtepi32_ps: sixteen int32 to float, lane by lane.
inline simde__m512 emulated_cvtepi32_ps(simde__m512i v) {
  simde__m512_private out;
  const simde__m512i_private in = simde__m512i_to_private(v);
  for (int i = 0; i < 16; ++i) out.f32[i] = float(in.i32[i]);
  return simde__m512_from_private(out);
}
#define _mm512_cvtepi32_ps emulated_cvtepi32_ps

#include "int_dot_avx512.h"

namespace kernels = xlaunch_llm::int_dot_avx512;

extern "C" int int8q(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, int64_t rows,
                     const int8_t* w, int64_t k, float* out) {
  switch (rows) {
    case 1: kernels::int8q_tile<1>(q, d, qsum, ldq, w, k, out); return 0;
    case 2: kernels::int8q_tile<2>(q, d, qsum, ldq, w, k, out); return 0;
    case 3: kernels::int8q_tile<3>(q, d, qsum, ldq, w, k, out); return 0;
    case 4: kernels::int8q_tile<4>(q, d, qsum, ldq, w, k, out); return 0;
    default: return 1;
  }
}

extern "C" int int4q(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, int64_t rows,
                     const uint8_t* w, const float* scales, int64_t group_size, int64_t k, float* out) {
  switch (rows) {
    case 1: kernels::int4q_tile<1>(q, d, qsum, ldq, w, scales, group_size, k, out); return 0;
    case 2: kernels::int4q_tile<2>(q, d, qsum, ldq, w, scales, group_size, k, out); return 0;
    case 3: kernels::int4q_tile<3>(q, d, qsum, ldq, w, scales, group_size, k, out); return 0;
    case 4: kernels::int4q_tile<4>(q, d, qsum, ldq, w, scales, group_size, k, out); return 0;
    default: return 1;
  }
}

extern "C" int int6q(const int8_t* q, const float* d, const int32_t* qsum, int64_t ldq, int64_t rows,
                     const uint8_t* w, const float* scales, int64_t group_size, int64_t k, float* out) {
  switch (rows) {
    case 1: kernels::int4q_tile<1, 6>(q, d, qsum, ldq, w, scales, group_size, k, out); return 0;
    case 2: kernels::int4q_tile<2, 6>(q, d, qsum, ldq, w, scales, group_size, k, out); return 0;
    case 3: kernels::int4q_tile<3, 6>(q, d, qsum, ldq, w, scales, group_size, k, out); return 0;
    case 4: kernels::int4q_tile<4, 6>(q, d, qsum, ldq, w, scales, group_size, k, out); return 0;
    default: return 1;
  }
}
