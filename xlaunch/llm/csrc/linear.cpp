// torch.ops.xlaunch_llm.{bf16,int8,int4,int6}_linear: y = x @ W.T (* scales) + bias over weights packed by
// xlaunch/llm/linear/ (layouts in linear.h), and fp32_linear over fp32 weights as ATen keeps them. Parallel
// over blocks of 64 output channels (at::parallel_for, so torch.get_num_threads() threads); each block is
// streamed once per kRowTile rows.
#include "linear.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <immintrin.h>
#include <optional>
#include <vector>

namespace xlaunch_llm {
namespace {

std::vector<int64_t> output_sizes(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  return sizes;
}

void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "xlaunch_llm linear: the input needs at least one dimension");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "xlaunch_llm linear: activations must be bfloat16 or float32, not ", x.scalar_type());
}

// The rows of x as a contiguous [M, width] tensor of dtype, zero-padded past K.
at::Tensor rows_of(const at::Tensor& x, at::ScalarType dtype, int64_t width) {
  const int64_t k = x.size(-1);
  at::Tensor flat = x.reshape({-1, k}).to(dtype).contiguous();
  if (width == k) return flat;
  return at::constant_pad_nd(flat, {0, width - k}, 0);
}

// out[m, n] = acc(m, n) * scale[n] + bias[n], written in out's dtype; block-wise from a kernel.
struct Epilogue {
  const float* scale;   // per output channel (padded to the blocks), or null
  const float* bias;    // [N] or null
  void* out;
  bool out_bf16;
  int64_t n;

  void store(const float* acc, int64_t m0, int64_t rows, int64_t block) const {
    const int64_t c0 = block * kBlock, width = std::min(kBlock, n - c0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; ++c) {
        float v = acc[r * kBlock + c];
        if (scale) v *= scale[c0 + c];
        if (bias) v += bias[c0 + c];
        const int64_t at = (m0 + r) * n + c0 + c;
        if (out_bf16) static_cast<uint16_t*>(out)[at] = float_to_bf16_bits(v);
        else static_cast<float*>(out)[at] = v;
      }
  }
};

// Activation rows quantized once per call for the integer kernels (linear.h: quantize_activations), from a
// contiguous [m, k] float32 or bfloat16 tensor: bf16 rows are widened one row at a time (exact), not into an
// fp32 copy of the whole input (a 2048-token prefill's down projection: 64 MiB), and the rows are shared
// between the threads (they were quantized on one). Zen 5 VM, 2 threads, 1B shape, 2048-token prefill:
// 1.5-3.5% faster, peak RSS 25 MiB lower; the serial share grows with the thread count.
struct QuantizedRows {
  int64_t ldq;
  at::Tensor values, scales, sums;

  explicit QuantizedRows(const at::Tensor& x)
      : ldq((x.size(1) + kQuantBlock - 1) / kQuantBlock * kQuantBlock),
        values(at::empty({x.size(0), ldq}, at::kChar)),
        scales(at::empty({x.size(0), ldq / kQuantBlock}, at::kFloat)),
        sums(at::empty({x.size(0), ldq / kQuantBlock}, at::kInt)) {
    const int64_t m = x.size(0), k = x.size(1);
    int8_t* q = values.data_ptr<int8_t>();
    float* d = scales.data_ptr<float>();
    int32_t* qsum = sums.data_ptr<int32_t>();
    const int64_t ldd = ldq / kQuantBlock, grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, k));
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const void* xp = x.data_ptr();
    at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
      if (!bf16) {
        quantize_activations(static_cast<const float*>(xp) + begin * k, k, end - begin, k, q + begin * ldq, ldq,
                             d + begin * ldd, qsum + begin * ldd);
        return;
      }
      std::vector<float> row(k);
      for (int64_t r = begin; r < end; ++r) {
        const uint16_t* bits = static_cast<const uint16_t*>(xp) + r * k;
        for (int64_t i = 0; i < k; ++i) row[i] = bf16_bits_to_float(bits[i]);
        quantize_activations(row.data(), k, 1, k, q + r * ldq, ldq, d + r * ldd, qsum + r * ldd);
      }
    });
  }
  const int8_t* q(int64_t row) const { return values.data_ptr<int8_t>() + row * ldq; }
  const float* d(int64_t row) const { return scales.data_ptr<float>() + row * (ldq / kQuantBlock); }
  const int32_t* qsum(int64_t row) const { return sums.data_ptr<int32_t>() + row * (ldq / kQuantBlock); }
};

// A thread takes at least kMinWork multiply-adds: a parallel region costs microseconds, and a small layer
// is quicker on one thread than shared.
constexpr int64_t kMinWork = int64_t(1) << 17;

template <typename Kernel>
void run_blocks(int64_t m, int64_t k, int64_t blocks, const Epilogue& epilogue, const Kernel& kernel) {
  const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, m * k * kBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float acc[kRowTile * kBlock];
    for (int64_t b = begin; b < end; ++b)
      for (int64_t m0 = 0; m0 < m; m0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, m - m0);
        kernel(b, m0, rows, acc);
        epilogue.store(acc, m0, rows, b);
      }
  });
}

at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "xlaunch_llm linear: the bias has ", bias->numel(), " values, not ", n);
  return bias->to(at::kFloat).contiguous();
}

Epilogue epilogue_for(const at::Tensor& out, const at::Tensor& bias, const float* scale, int64_t n) {
  return Epilogue{scale, bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr(),
                  out.scalar_type() == at::kBFloat16, n};
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n) {
  const int64_t k = x.size(-1), k_pairs = packed.size(1);
  check_input(x);
  check_packed("bf16_linear", packed, at::kBFloat16, nullptr, n, k, 0);
  const bool fp32 = x.scalar_type() == at::kFloat;   // fp32 activations: multiplied as they are, not rounded
  at::Tensor rows = rows_of(x, fp32 ? at::kFloat : at::kBFloat16, 2 * k_pairs);
  const int64_t m = rows.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor b = float_bias(bias, n);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* xf = fp32 ? rows.data_ptr<float>() : nullptr;
  const auto* xb = fp32 ? nullptr : reinterpret_cast<const uint16_t*>(rows.data_ptr());
  run_blocks(m, k, packed.size(0), epilogue_for(out, b, nullptr, n), [&](int64_t blk, int64_t m0, int64_t r, float* acc) {
    const uint16_t* block = wp + blk * k_pairs * 2 * kBlock;
    if (fp32) bf16_f32_block(xf + m0 * 2 * k_pairs, 2 * k_pairs, r, block, k_pairs, acc);
    else bf16_block(xb + m0 * 2 * k_pairs, 2 * k_pairs, r, block, k_pairs, acc);
  });
  return out.view(output_sizes(x, n));
}

// fp32 weights in ATen's layout ([N, K]) for a few rows: the output channels split between the threads. ATen's
// GEMV runs on one thread (torch 2.13 here): a 32000 x 768 lm_head at one row took 5.9 ms at 1 and 2 threads
// on the Zen 5 VM, the bf16 kernel 0.73 ms on half the bytes. Many rows (prefill) go to ATen's GEMM instead.
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_input(x);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "xlaunch_llm fp32_linear: the weight must be a contiguous float32 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(-1) == k, "xlaunch_llm fp32_linear: the input has ", x.size(-1), " features, the weight ", k);
  at::Tensor rows = rows_of(x, at::kFloat, k);
  const int64_t m = rows.size(0);
  at::Tensor out = at::empty({m, n}, rows.options());
  at::Tensor b = float_bias(bias, n);
  const float* xp = rows.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, m * k));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { fp32_rows(xp, m, k, wp, begin, end, op, n); });
  if (b.defined()) out.add_(b);
  return out.view(output_sizes(x, n));
}

at::Tensor fp32_linear_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>&) {
  return at::empty(output_sizes(x, weight.size(0)), x.options().dtype(at::kFloat));
}

// From this many activation rows an INT8 layer without integer dot products (the baseline level) widens
// each block to bf16 once instead of converting every weight once per tile of kRowTile rows (prefill).
// The integer kernels are faster than that panel at every row count: 1.4-2.7x on the AVX2 VM (8192 x 2048
// and 2048 x 8192, 8-64 rows, 1 and 2 threads), 2.3-3.1x with VNNI on the 16-core AMX Xeon (32 rows, 4 and 16 threads).
constexpr int64_t kPanelRows = 8;

// One int8 block [K/4][64][4] as the bf16 kernel's layout [K/2][64][2] (K padded to even with zeros): a
// channel's pair is one 32-bit word, bf16 of row 2kp in the low half, of row 2kp+1 in the high half
// (an int8 value is exact in bf16). The baseline level's prefill only: the other levels run the integer kernels.
void widen_int8_block(const int8_t* w, int64_t k, int64_t k_pairs, std::vector<uint16_t>& panel) {
  panel.resize(size_t(k_pairs) * 2 * kBlock);
  auto value = [&](int64_t kk, int64_t c) -> uint32_t {
    return kk < k ? uint32_t(float_to_bf16_bits(float(w[int8_offset(kk, c)]))) : 0u;
  };
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    auto* dst = reinterpret_cast<uint32_t*>(panel.data() + kp * 2 * kBlock);
    for (int64_t c = 0; c < kBlock; ++c) dst[c] = (value(2 * kp + 1, c) << 16) | value(2 * kp, c);
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  const int64_t k = x.size(-1);
  check_input(x);
  check_packed("int8_linear", packed, at::kChar, &scales, n, k, 0);
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t m_all = x.numel() / std::max<int64_t>(1, k);
  if (x.scalar_type() == at::kBFloat16 && m_all >= kPanelRows && quantized_activation_block() == 0) {
    // Prefill: each block widened once to bf16 (int8 values are exact in bf16, and so are the
    // products of two bf16s in fp32), then every row tile runs the bf16 kernel from cache.
    const int64_t k_pairs = (k + 1) / 2;
    at::Tensor rows = rows_of(x, at::kBFloat16, 2 * k_pairs);
    at::Tensor out = at::empty({m_all, n}, x.options());
    at::Tensor b = float_bias(bias, n);
    const auto* xp = reinterpret_cast<const uint16_t*>(rows.data_ptr());
    run_blocks(m_all, k, packed.size(0), epilogue_for(out, b, scales.data_ptr<float>(), n),
               [&](int64_t blk, int64_t m0, int64_t r, float* acc) {
                 thread_local std::vector<uint16_t> panel;
                 if (m0 == 0) widen_int8_block(wp + blk * int8_block_bytes(k), k, k_pairs, panel);   // the first tile of a block
                 bf16_block(xp + m0 * 2 * k_pairs, 2 * k_pairs, r, panel.data(), k_pairs, acc);
               });
    return out.view(output_sizes(x, n));
  }
  // integer dot products over quantized activations (AVX2, VNNI) from x as it is; else fp32 activations
  const bool quantized = quantized_activation_block() > 0;
  at::Tensor rows = rows_of(x, quantized ? x.scalar_type() : at::kFloat, k);
  const int64_t m = rows.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor b = float_bias(bias, n);
  if (quantized) {
    const QuantizedRows qx(rows);
    run_blocks(m, k, packed.size(0), epilogue_for(out, b, scales.data_ptr<float>(), n),
               [&](int64_t blk, int64_t m0, int64_t r, float* acc) {
                 int8q_block(qx.q(m0), qx.d(m0), qx.qsum(m0), qx.ldq, r, wp + blk * int8_block_bytes(k), k, acc);
               });
    return out.view(output_sizes(x, n));
  }
  const float* xp = rows.data_ptr<float>();
  run_blocks(m, k, packed.size(0), epilogue_for(out, b, scales.data_ptr<float>(), n),
             [&](int64_t blk, int64_t m0, int64_t r, float* acc) {
               int8_block(xp + m0 * k, k, r, wp + blk * int8_block_bytes(k), k, acc);
             });
  return out.view(output_sizes(x, n));
}

// INT4 (bits 4) and INT6 (bits 6) layers: the same group scales and nibble layout, INT6 with each step's
// high bits after its nibbles (linear.h).
at::Tensor nibble_linear(const char* op, int bits, const at::Tensor& x, const at::Tensor& packed,
                         const at::Tensor& scales, const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size) {
  const int64_t k = x.size(-1);
  check_input(x);
  check_packed(op, packed, at::kByte, &scales, n, k, group_size, bits);
  const int64_t groups = k / group_size, block_bytes = (k / 4) * nibble_step_bytes(bits);
  // integer dot products over quantized activations (AVX2, VNNI) from x as it is; else bf16 activations
  const bool quantized = quantized_activation_block() > 0;
  TORCH_CHECK(!quantized || group_size % kQuantBlock == 0, "xlaunch_llm ", op, ": the group size ", group_size,
              " is not a multiple of ", kQuantBlock, " (the activations' block)");
  at::Tensor rows = rows_of(x, quantized ? x.scalar_type() : at::kBFloat16, k);
  const int64_t m = rows.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor b = float_bias(bias, n);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  if (quantized) {
    const QuantizedRows qx(rows);
    run_blocks(m, k, packed.size(0), epilogue_for(out, b, nullptr, n), [&](int64_t blk, int64_t m0, int64_t r, float* acc) {
      int4q_block(qx.q(m0), qx.d(m0), qx.qsum(m0), qx.ldq, r, wp + blk * block_bytes, sp + blk * groups * kBlock,
                  groups, group_size, acc, bits);
    });
    return out.view(output_sizes(x, n));
  }
  at::Tensor sums = rows.to(at::kFloat).view({m, groups, group_size}).sum(-1).contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  const float* gp = sums.data_ptr<float>();
  run_blocks(m, k, packed.size(0), epilogue_for(out, b, nullptr, n), [&](int64_t blk, int64_t m0, int64_t r, float* acc) {
    int4_block(xp + m0 * k, k, r, wp + blk * block_bytes, sp + blk * groups * kBlock, gp + m0 * groups,
               groups, group_size, acc, bits);
  });
  return out.view(output_sizes(x, n));
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size) {
  return nibble_linear("int4_linear", 4, x, packed, scales, bias, n, group_size);
}

at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size) {
  return nibble_linear("int6_linear", 6, x, packed, scales, bias, n, group_size);
}

// Shapes only, for torch.compile's fake tensors.
at::Tensor bf16_linear_meta(const at::Tensor& x, const at::Tensor&, const std::optional<at::Tensor>&, int64_t n) {
  return at::empty(output_sizes(x, n), x.options());
}
at::Tensor int8_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, int64_t n) {
  return at::empty(output_sizes(x, n), x.options());
}
// 32 when this build's INT8/INT4 kernels quantize the activations (integer dot products: AVX2, VNNI), 0 when
// they take them as they are.
int64_t activation_block() { return quantized_activation_block(); }

at::Tensor int4_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, int64_t n, int64_t) {
  return at::empty(output_sizes(x, n), x.options());
}

}  // namespace

void check_packed(const char* op, const at::Tensor& packed, at::ScalarType type, const at::Tensor* scales,
                  int64_t n, int64_t k, int64_t group_size, int bits) {
  const char* kind = type == at::kBFloat16 ? "bf16" : type == at::kChar ? "int8" : bits == 6 ? "int6" : "int4";
  TORCH_CHECK(packed.scalar_type() == type && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (n + kBlock - 1) / kBlock,
              "xlaunch_llm ", op, ": the packed weight is not ", kind, " weights of [", n, ", ", k,
              "] packed by PackedLinear");
  if (type == at::kBFloat16) {
    TORCH_CHECK(packed.size(1) == (k + 1) / 2 && packed.size(2) == 2 * kBlock,
                "xlaunch_llm ", op, ": the packed weight must be bfloat16 [N/64, K/2, 128]");
    return;
  }
  if (type == at::kByte)
    TORCH_CHECK(group_size % 4 == 0 && group_size > 0 && k % group_size == 0,
                "xlaunch_llm ", op, ": in_features ", k, " is not a multiple of the group size ", group_size);
  TORCH_CHECK(type == at::kChar ? packed.size(1) == (k + 3) / 4 && packed.size(2) == 4 * kBlock
                                : packed.size(1) * 4 == k && packed.size(2) == nibble_step_bytes(bits),
              "xlaunch_llm ", op, type == at::kChar ? ": the packed weight must be int8 [N/64, K/4, 256]"
                                  : bits == 6       ? ": the packed weight must be uint8 [N/64, K/4, 192]"
                                                    : ": the packed weight must be uint8 [N/64, K/4, 128]");
  const int64_t groups = type == at::kChar ? 1 : k / group_size;
  TORCH_CHECK(scales != nullptr && scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                  scales->numel() == packed.size(0) * groups * kBlock,
              "xlaunch_llm ", op, ": scales must be float32 [N/64, K/group, 64] (one per packed channel for int8)");
}

}  // namespace xlaunch_llm

TORCH_LIBRARY_FRAGMENT(XLAUNCH_OPS, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int out_features, int group_size) -> Tensor");
  m.def("int6_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int out_features, int group_size) -> Tensor");
  m.def("linear_activation_block() -> int", &xlaunch_llm::activation_block);
}

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, CPU, m) {
  m.impl("bf16_linear", &xlaunch_llm::bf16_linear);
  m.impl("fp32_linear", &xlaunch_llm::fp32_linear);
  m.impl("int8_linear", &xlaunch_llm::int8_linear);
  m.impl("int4_linear", &xlaunch_llm::int4_linear);
  m.impl("int6_linear", &xlaunch_llm::int6_linear);
}

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, Meta, m) {
  m.impl("bf16_linear", &xlaunch_llm::bf16_linear_meta);
  m.impl("fp32_linear", &xlaunch_llm::fp32_linear_meta);
  m.impl("int8_linear", &xlaunch_llm::int8_linear_meta);
  m.impl("int4_linear", &xlaunch_llm::int4_linear_meta);
  m.impl("int6_linear", &xlaunch_llm::int4_linear_meta);
}
