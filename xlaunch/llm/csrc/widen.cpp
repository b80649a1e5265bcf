// torch.ops.xlaunch_llm.widen_weight_: a packed weight (layouts in linear.h) written into a dense [N, K]
// float32 or bfloat16 tensor (the caller's, reused: first-touch page faults of a fresh one cost more
// than the widening), for ATen's GEMM (xlaunch/llm/kernel_choice.py's route for many rows). bf16
// weights are copied as they are; int8/int4/int6 ones are their integers times their fp32 scales, rounded
// once to the output dtype. Parallel over the blocks of 64 output channels: on the 16-core AMX Xeon
// torch's permute-and-copy took 7.5 ms (bf16), 20 ms (int8) and 35 ms (int4) for an 8192 x 2048 weight.
#include "linear.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

namespace xlaunch_llm {
namespace {

// One output value from its fp32 weight, in the output's dtype.
template <bool Bf16Out>
inline void put(void* out, int64_t at, float value) {
  if constexpr (Bf16Out) static_cast<uint16_t*>(out)[at] = float_to_bf16_bits(value);
  else static_cast<float*>(out)[at] = value;
}

constexpr int64_t kTile = 32;   // k values a pass writes per channel: the block's tile stays in L1

// One int4 or int6 block (linear_layout.h: nibble_value); a group is a multiple of 4 values, so a step's four
// share one scale.
template <bool Bf16Out, int Bits>
void widen_nibbles(const at::Tensor& packed, const float* scales, int64_t block, int64_t n, int64_t k,
                   int64_t group_size, void* out) {
  const int64_t c0 = block * kBlock, width = std::min(kBlock, n - c0), groups = k / group_size;
  const int64_t step_bytes = nibble_step_bytes(Bits), zero = 1 << (Bits - 1);
  const uint8_t* w = packed.data_ptr<uint8_t>() + block * (k / 4) * step_bytes;
  const float* s = scales + block * groups * kBlock;
  for (int64_t k0 = 0; k0 < k; k0 += kTile) {
    const int64_t k1 = std::min(k, k0 + kTile);
    for (int64_t c = 0; c < width; ++c)
      for (int64_t kk = k0; kk < k1; kk += 4) {
        const uint8_t* step = w + (kk / 4) * step_bytes;
        const float scale = s[(kk / group_size) * kBlock + c];
        for (int t = 0; t < 4; ++t) put<Bf16Out>(out, (c0 + c) * k + kk + t, float(nibble_value<Bits>(step, c, t) - zero) * scale);
      }
  }
}

// One block's channels, kTile k values at a time: the tile's packed bytes are read once from L1 while
// each channel's row of the output is written in runs of kTile. bits: 6 for an int6 weight (uint8), else 4.
template <bool Bf16Out>
void widen_block(const at::Tensor& packed, const float* scales, int64_t block, int64_t n, int64_t k,
                 int64_t group_size, int bits, void* out) {
  const int64_t c0 = block * kBlock, width = std::min(kBlock, n - c0);
  if (packed.scalar_type() == at::kBFloat16) {          // [N/64, K2, 64 x 2]: channel c's (k, k+1) pairs
    const int64_t k2 = packed.size(1);
    const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr()) + block * k2 * 2 * kBlock;
    for (int64_t k0 = 0; k0 < k; k0 += kTile) {
      const int64_t k1 = std::min(k, k0 + kTile);
      for (int64_t c = 0; c < width; ++c)
        for (int64_t kk = k0; kk < k1; ++kk) {
          const uint16_t word = w[(kk >> 1) * 2 * kBlock + 2 * c + (kk & 1)];
          if constexpr (Bf16Out) static_cast<uint16_t*>(out)[(c0 + c) * k + kk] = word;
          else static_cast<float*>(out)[(c0 + c) * k + kk] = bf16_bits_to_float(word);
        }
    }
  } else if (packed.scalar_type() == at::kChar) {      // [N/64, K/4, 64 x 4]; scales [N/64, 64]
    const int8_t* w = packed.data_ptr<int8_t>() + block * int8_block_bytes(k);
    for (int64_t k0 = 0; k0 < k; k0 += kTile) {
      const int64_t k1 = std::min(k, k0 + kTile);
      for (int64_t c = 0; c < width; ++c) {
        const float scale = scales[c0 + c];
        for (int64_t kk = k0; kk < k1; ++kk)
          put<Bf16Out>(out, (c0 + c) * k + kk, float(w[int8_offset(kk, c)]) * scale);
      }
    }
  } else if (bits == 6) {                              // int6: uint8 [N/64, K/4, 192]; scales [N/64, G, 64]
    widen_nibbles<Bf16Out, 6>(packed, scales, block, n, k, group_size, out);
  } else {                                              // int4: uint8 [N/64, K/4, 64 x 2]; scales [N/64, G, 64]
    widen_nibbles<Bf16Out, 4>(packed, scales, block, n, k, group_size, out);
  }
}

void widen_weight_(at::Tensor& out, const at::Tensor& packed, const std::optional<at::Tensor>& scales,
                   int64_t group_size) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && (out.scalar_type() == at::kFloat ||
              out.scalar_type() == at::kBFloat16), "xlaunch_llm widen_weight_: out must be a contiguous "
              "float32 or bfloat16 [N, K] tensor");
  const int64_t n = out.size(0), k = out.size(1);
  const auto type = packed.scalar_type();
  TORCH_CHECK(type == at::kBFloat16 || type == at::kChar || type == at::kByte,
              "xlaunch_llm widen_weight_: bf16, int8 or uint8 (int4, int6) weights, not ", type);
  const int bits = type == at::kByte && packed.dim() == 3 && packed.size(2) == nibble_step_bytes(6) ? 6 : 4;
  check_packed("widen_weight_", packed, type, scales.has_value() ? &*scales : nullptr, n, k, group_size, bits);
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  const float* s = type == at::kBFloat16 ? nullptr : scales->data_ptr<float>();
  void* o = out.data_ptr();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      if (bf16_out) widen_block<true>(packed, s, block, n, k, group_size, bits, o);
      else widen_block<false>(packed, s, block, n, k, group_size, bits, o);
    }
  });
}

}  // namespace
}  // namespace xlaunch_llm

TORCH_LIBRARY_FRAGMENT(XLAUNCH_OPS, m) {
  m.def("widen_weight_(Tensor(a!) out, Tensor packed, Tensor? scales, int group_size) -> ()");
}

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, CPU, m) { m.impl("widen_weight_", &xlaunch_llm::widen_weight_); }
