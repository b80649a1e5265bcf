// compiled_isa(): the ISA level this library was compiled at, read from the compiler's own macros
// (so a test can see which level's code a process runs). One library per level: -DXLAUNCH_OPS names
// its operator namespace (xlaunch_<package>_<level>), see xlaunch/_native_build.py.
#include <torch/library.h>

#include <string>

namespace {

std::string compiled_isa() {
#if defined(__AMX_TILE__)
  return "amx";
#elif defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return "avx512_bf16";
#elif defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512_vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "baseline";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(XLAUNCH_OPS, m) { m.def("compiled_isa() -> str", &compiled_isa); }
