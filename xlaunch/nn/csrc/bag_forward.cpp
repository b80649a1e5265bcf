// Merged embedding bags, forward: every table's bags pooled (sum, mean, max; per-sample weights)
// in one call, threads sharing the (table, bag) pairs. Rows are prefetched a few lookups ahead,
// across bag boundaries; common dims are compiled in, so a bag's sums stay in registers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "bag_common.h"

namespace xlaunch_nn {
namespace {


// One bag. FIXED > 0 is the table's dim known at compile time (its sums then stay in registers).
template <int FIXED, typename W, typename I>
void pool_bag(const Inputs<I>& in, int64_t t, int64_t b, const W* weight, W* out, float* __restrict__ scratch) {
  const Table& tab = in.tables[t];
  const int64_t dim = FIXED > 0 ? FIXED : tab.dim;
  float local[FIXED > 0 ? FIXED : 1];
  float* __restrict__ acc = FIXED > 0 ? local : scratch;
  const I* idx = in.indices[t];
  const W* psw = static_cast<const W*>(in.weights[t]);
  const int64_t begin = in.bag_begin(t, b), end = in.bag_end(t, b);
  const W* base = weight + tab.weight_offset;
  W* dst = out + tab.out_offset + b * tab.out_stride;
  if (begin == end) {
    for (int64_t d = 0; d < dim; ++d) store(dst + d, 0.0f);
    return;
  }
  for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
  // Prefetch runs ahead through the table's indices, past this bag into the next ones.
  const int64_t prefetch_end = tab.n_lookups;
  for (int64_t j = begin; j < end; ++j) {
    if (j + kPrefetchAhead < prefetch_end) {
      const I ahead = idx[j + kPrefetchAhead];
      if (ahead >= 0 && ahead < tab.rows) prefetch_row(base + int64_t(ahead) * dim, dim);
    }
    const I r = idx[j];
    if (r < 0 || r >= tab.rows) bad_index(t, j, r, tab.rows);
    const W* __restrict__ row = base + int64_t(r) * dim;
    if (tab.mode == MAX) {
      // torch's rule: the bag's first row, then any larger value (a NaN first stays, a later one
      // is skipped; std::max from -inf dropped every NaN, so a bag of one NaN row came out -inf)
      if (j == begin) {
        for (int64_t d = 0; d < dim; ++d) acc[d] = load(row + d);
      } else {
        for (int64_t d = 0; d < dim; ++d) {
          const float v = load(row + d);
          acc[d] = v > acc[d] ? v : acc[d];
        }
      }
    } else if (psw != nullptr) {
      const float s = load(psw + j);
      for (int64_t d = 0; d < dim; ++d) acc[d] += s * load(row + d);
    } else {
      for (int64_t d = 0; d < dim; ++d) acc[d] += load(row + d);
    }
  }
  if (tab.mode == MEAN) {
    const float scale = 1.0f / float(end - begin);
    for (int64_t d = 0; d < dim; ++d) store(dst + d, acc[d] * scale);
  } else {
    for (int64_t d = 0; d < dim; ++d) store(dst + d, acc[d]);
  }
}

template <typename W, typename I>
void forward_typed(const Inputs<I>& in, const W* weight, const std::vector<W*>& outs) {
  const int64_t batch = in.batch, n_tables = int64_t(in.tables.size());
  at::parallel_for(0, n_tables * batch, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(in.max_dim);
    for (int64_t tb = begin; tb < end; ++tb) {
      const int64_t t = tb / batch, b = tb % batch;
      switch (in.tables[t].dim) {
        case 16: pool_bag<16>(in, t, b, weight, outs[t], acc.data()); break;
        case 32: pool_bag<32>(in, t, b, weight, outs[t], acc.data()); break;
        case 64: pool_bag<64>(in, t, b, weight, outs[t], acc.data()); break;
        case 128: pool_bag<128>(in, t, b, weight, outs[t], acc.data()); break;
        default: pool_bag<0>(in, t, b, weight, outs[t], acc.data());
      }
    }
  });
}

void bag_forward(const at::Tensor& weight, at::TensorList indices, at::TensorList offsets,
                 const c10::List<std::optional<at::Tensor>>& per_sample_weights, const at::Tensor& meta,
                 int64_t batch, at::TensorList outs) {
  TORCH_CHECK(weight.is_contiguous(), "xlaunch_nn: the weight storage must be contiguous");
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || weight.scalar_type() == at::kFloat, "xlaunch_nn: weights must be float32 or bfloat16");
  const bool i32 = int32_indices(indices, offsets);
  auto run = [&](auto index_tag) {
    using I = decltype(index_tag);
    auto in = read_inputs<I>(indices, offsets, per_sample_weights, meta, batch, weight.numel());
    if (bf16) {
      forward_typed(in, reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                    table_tensors<uint16_t>(outs, in.tables, batch, weight.scalar_type(), "out"));
    } else {
      forward_typed(in, weight.data_ptr<float>(), table_tensors<float>(outs, in.tables, batch, weight.scalar_type(), "out"));
    }
  };
  if (i32) run(int32_t{}); else run(int64_t{});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(XLAUNCH_OPS, m) {
  m.def("bag_forward(Tensor weight, Tensor[] indices, Tensor[] offsets, Tensor?[] per_sample_weights, "
        "Tensor meta, int batch, Tensor(a!)[] outs) -> ()");
}

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, CPU, m) {  // CPU tensors only: another device's data is never read here
  m.impl("bag_forward", &bag_forward);
}

}  // namespace xlaunch_nn
