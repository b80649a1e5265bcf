// Merged embedding bags, backward fused with the update of the touched rows (or, for a plain
// MergedEmbeddingBag, the dense gradient written row by row).
//
// Every lookup becomes a (global row, lookup) pair; each table's pairs are radix-sorted by row
// (stable, so each row's contributions are summed in lookup order; one table at a time stays in
// the L2 cache), and each thread then owns whole runs of equal rows: it sums their upstream
// gradients in fp32 and updates the row (SGD, Adagrad; bf16 weights through their split fp32
// master) with no atomics and the same result for any thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "bag_common.h"

namespace xlaunch_nn {
namespace {


// Stable LSD radix sort of n (key, value) pairs by key - base, for keys in [base, base + span),
// with at most 11 bits per pass. The sorted pairs end in (keys, values); the tmp buffers are
// scratch. One table's lookups at a time: its buffers stay in the L2 cache.
void radix_sort(uint32_t* keys, uint32_t* values, uint32_t* keys_tmp, uint32_t* values_tmp, int64_t n, uint32_t base,
                uint64_t span) {
  int bits = 0;
  while (bits < 32 && ((span - 1) >> bits) != 0) ++bits;
  if (n < 2 || bits == 0) return;
  const int passes = (bits + 10) / 11;
  const int digit_bits = (bits + passes - 1) / passes;
  const uint32_t mask = (1u << digit_bits) - 1;
  std::vector<int64_t> count(size_t(1) << digit_bits);
  uint32_t *k_in = keys, *v_in = values, *k_out = keys_tmp, *v_out = values_tmp;
  for (int shift = 0; shift < bits; shift += digit_bits) {
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++count[((k_in[i] - base) >> shift) & mask];
    int64_t running = 0;
    for (auto& c : count) {
      const int64_t here = c;
      c = running;
      running += here;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = count[((k_in[i] - base) >> shift) & mask]++;
      k_out[pos] = k_in[i];
      v_out[pos] = v_in[i];
    }
    std::swap(k_in, k_out);
    std::swap(v_in, v_out);
  }
  if (k_in != keys) {
    std::copy(k_in, k_in + n, keys);
    std::copy(v_in, v_in + n, values);
  }
}

struct Update {
  int64_t kind;
  float lr, weight_decay, eps;
};

// Applies the summed gradient `acc` of one row: writes it (dense gradient), or updates the row.
template <typename W>
void update_row(const Update& u, const float* __restrict__ acc, int64_t dim, int64_t offset, W* weight, uint16_t* trail,
                void* state, float* __restrict__ scratch) {
  if (u.kind == WRITE_GRAD) {
    W* grad = static_cast<W*>(state) + offset;
    for (int64_t d = 0; d < dim; ++d) store(grad + d, acc[d]);
    return;
  }
  W* w = weight + offset;
  uint16_t* tr = trail == nullptr ? nullptr : trail + offset;
  float* __restrict__ master;  // fp32 weights are updated in place; bf16 ones through scratch
  if constexpr (std::is_same<W, float>::value) {
    master = w;
  } else {
    master = scratch;
    if (tr != nullptr) {
      for (int64_t d = 0; d < dim; ++d) master[d] = join_master(w[d], tr[d]);
    } else {
      for (int64_t d = 0; d < dim; ++d) master[d] = bf16_to_float(w[d]);
    }
  }
  const float lr = u.lr, wd = u.weight_decay, eps = u.eps;
  if (u.kind == SGD) {  // torch.optim.SGD: g = grad + wd * w; w = w - lr * g
    if (wd != 0.0f) {
      for (int64_t d = 0; d < dim; ++d) master[d] -= lr * (acc[d] + wd * master[d]);
    } else {
      for (int64_t d = 0; d < dim; ++d) master[d] -= lr * acc[d];
    }
  } else {  // torch.optim.Adagrad: sum += g * g; w = w - lr * g / (sqrt(sum) + eps)
    float* __restrict__ sum = static_cast<float*>(state) + offset;
    for (int64_t d = 0; d < dim; ++d) {
      sum[d] += acc[d] * acc[d];
      master[d] -= lr * (acc[d] / (std::sqrt(sum[d]) + eps));
    }
  }
  if constexpr (!std::is_same<W, float>::value) {
    if (tr != nullptr) {
      for (int64_t d = 0; d < dim; ++d) split_master(master[d], w + d, tr + d);
    } else {
      for (int64_t d = 0; d < dim; ++d) w[d] = float_to_bf16(master[d]);
    }
  }
}

template <typename W, typename I>
void backward_typed(const Inputs<I>& in, const std::vector<W*>& grads, const Update& u, W* weight, uint16_t* trail,
                    void* state) {
  const int64_t n_tables = int64_t(in.tables.size()), batch = in.batch;
  std::vector<int64_t> lookup_base(n_tables + 1, 0);
  int64_t total_rows = 0;
  for (int64_t t = 0; t < n_tables; ++t) {
    lookup_base[t + 1] = lookup_base[t] + in.tables[t].n_lookups;
    total_rows = std::max(total_rows, in.tables[t].row_base + in.tables[t].rows);
  }
  const int64_t n = lookup_base[n_tables];
  TORCH_CHECK(n < (int64_t(1) << 32) && total_rows <= (int64_t(1) << 32),
              "xlaunch_nn: the fused backward handles up to 2^32 lookups and rows");
  if (n == 0) return;
  // The value sorted along with each row: the lookup's bag (t * batch + b) when no table has
  // per-sample weights (its scale is then per bag), else the lookup's position.
  bool by_position = false;
  for (int64_t t = 0; t < n_tables; ++t) by_position = by_position || in.weights[t] != nullptr;
  std::vector<uint32_t> keys(n), values(n), keys_tmp(n), values_tmp(n), bag_of(by_position ? n : 0);
  std::vector<float> scale(by_position ? n : n_tables * batch);
  at::parallel_for(0, n_tables * batch, 256, [&](int64_t begin, int64_t end) {
    for (int64_t tb = begin; tb < end; ++tb) {
      const int64_t t = tb / batch, b = tb % batch;
      const Table& tab = in.tables[t];
      const I* idx = in.indices[t];
      const W* psw = static_cast<const W*>(in.weights[t]);
      const int64_t j0 = in.bag_begin(t, b), j1 = in.bag_end(t, b);
      const float bag_scale = tab.mode == MEAN && j1 > j0 ? 1.0f / float(j1 - j0) : 1.0f;
      if (!by_position) scale[tb] = bag_scale;
      for (int64_t j = j0; j < j1; ++j) {
        const I r = idx[j];
        if (r < 0 || r >= tab.rows) bad_index(t, j, r, tab.rows);
        const int64_t pos = lookup_base[t] + j;
        keys[pos] = uint32_t(tab.row_base + r);
        if (by_position) {
          values[pos] = uint32_t(pos);
          bag_of[pos] = uint32_t(b);
          scale[pos] = psw != nullptr ? bag_scale * load(psw + j) : bag_scale;
        } else {
          values[pos] = uint32_t(tb);
        }
      }
    }
  });
  at::parallel_for(0, n_tables, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = lookup_base[t];
      radix_sort(keys.data() + b, values.data() + b, keys_tmp.data() + b, values_tmp.data() + b, lookup_base[t + 1] - b,
                 uint32_t(in.tables[t].row_base), uint64_t(std::max<int64_t>(in.tables[t].rows, 1)));
    }
  });
  const uint32_t* skeys = keys.data();
  const uint32_t* svalues = values.data();

  // Tables in row order, to find the table of a global row.
  std::vector<int64_t> order(n_tables);
  for (int64_t t = 0; t < n_tables; ++t) order[t] = t;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return in.tables[a].row_base < in.tables[b].row_base; });

  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(n, int64_t(at::get_num_threads()) * 8));
  std::vector<int64_t> cut(parts + 1);
  for (int64_t p = 0; p <= parts; ++p) {
    int64_t i = n * p / parts;
    while (i > 0 && i < n && skeys[i] == skeys[i - 1]) ++i;  // a run of one row stays in one part
    cut[p] = i;
  }
  // Table of a global row (tables sorted by row_base, found by binary search).
  std::vector<int64_t> bases(n_tables);
  for (int64_t k = 0; k < n_tables; ++k) bases[k] = in.tables[order[k]].row_base;
  auto table_of_key = [&](uint32_t key) {
    int64_t k = int64_t(std::upper_bound(bases.begin(), bases.end(), int64_t(key)) - bases.begin()) - 1;
    while (int64_t(key) >= in.tables[order[k]].row_base + in.tables[order[k]].rows) ++k;
    return order[k];
  };
  // Brings entry i's upstream gradient row and the row it updates towards the cache.
  auto prefetch_entry = [&](int64_t i) {
    const uint32_t v = svalues[i];
    if (by_position) return;  // the bag is one more dependent load away: not worth it
    const int64_t t = v / batch;
    const Table& tab = in.tables[t];
    prefetch_row(grads[t] + tab.out_offset + int64_t(v - t * batch) * tab.out_stride, tab.dim);
    const int64_t at_elem = tab.weight_offset + (int64_t(skeys[i]) - tab.row_base) * tab.dim;
    if (u.kind == WRITE_GRAD) {
      prefetch_row(static_cast<W*>(state) + at_elem, tab.dim, 1);
      return;
    }
    prefetch_row(weight + at_elem, tab.dim, 1);
    if (trail != nullptr) prefetch_row(trail + at_elem, tab.dim, 1);
    if (u.kind == ADAGRAD) prefetch_row(static_cast<float*>(state) + at_elem, tab.dim, 1);
  };
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(in.max_dim), scratch(in.max_dim);
    int64_t t = -1, lo = 0, hi = 0;  // the current table and its global rows [lo, hi)
    for (int64_t p = p0; p < p1; ++p) {
      int64_t i = cut[p];
      const int64_t stop = cut[p + 1];
      while (i < stop) {
        const uint32_t key = skeys[i];
        if (int64_t(key) < lo || int64_t(key) >= hi) {
          t = table_of_key(key);
          lo = in.tables[t].row_base;
          hi = lo + in.tables[t].rows;
        }
        const Table& tab = in.tables[t];
        // Sums the run of `key` (entries i.. while the key repeats) and applies it to the row.
        auto run = [&](auto fixed) {
          constexpr int FIXED = decltype(fixed)::value;
          const int64_t dim = FIXED > 0 ? FIXED : tab.dim;
          float local[FIXED > 0 ? FIXED : 1];
          float* __restrict__ a = FIXED > 0 ? local : acc.data();
          for (int64_t d = 0; d < dim; ++d) a[d] = 0.0f;
          for (; i < stop && skeys[i] == key; ++i) {
            if (i + kPrefetchAhead < stop) prefetch_entry(i + kPrefetchAhead);
            const uint32_t v = svalues[i];
            const float s = scale[v];
            const int64_t bag = by_position ? int64_t(bag_of[v]) : int64_t(v) - t * batch;
            const W* g = grads[t] + tab.out_offset + bag * tab.out_stride;
            for (int64_t d = 0; d < dim; ++d) a[d] += s * load(g + d);
          }
          update_row(u, a, dim, tab.weight_offset + (int64_t(key) - tab.row_base) * dim, weight, trail, state,
                     scratch.data());
        };
        switch (tab.dim) {
          case 16: run(std::integral_constant<int, 16>{}); break;
          case 32: run(std::integral_constant<int, 32>{}); break;
          case 64: run(std::integral_constant<int, 64>{}); break;
          case 128: run(std::integral_constant<int, 128>{}); break;
          default: run(std::integral_constant<int, 0>{});
        }
      }
    }
  });
}

void bag_backward(at::TensorList grads, at::TensorList indices, at::TensorList offsets,
                  const c10::List<std::optional<at::Tensor>>& per_sample_weights, const at::Tensor& meta,
                  int64_t batch, int64_t kind, at::Tensor& weight, at::Tensor& trail, at::Tensor& state,
                  double lr, double weight_decay, double eps) {
  TORCH_CHECK(kind == WRITE_GRAD || kind == SGD || kind == ADAGRAD, "xlaunch_nn: unknown update kind ", kind);
  TORCH_CHECK(weight.is_contiguous(), "xlaunch_nn: the weight storage must be contiguous");
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || weight.scalar_type() == at::kFloat, "xlaunch_nn: weights must be float32 or bfloat16");
  uint16_t* trail_ptr = nullptr;
  if (trail.numel() > 0) {
    TORCH_CHECK(bf16 && trail.scalar_type() == at::kShort && trail.numel() == weight.numel() && trail.is_contiguous(),
                "xlaunch_nn: the trail must be an int16 tensor shaped like the bf16 weight");
    trail_ptr = reinterpret_cast<uint16_t*>(trail.data_ptr());
  }
  if (kind == WRITE_GRAD) {
    TORCH_CHECK(state.scalar_type() == weight.scalar_type() && state.numel() == weight.numel() && state.is_contiguous(),
                "xlaunch_nn: the gradient target must be shaped like the weight");
  } else if (kind == ADAGRAD) {
    TORCH_CHECK(state.scalar_type() == at::kFloat && state.numel() == weight.numel() && state.is_contiguous(),
                "xlaunch_nn: the Adagrad state must be a float32 tensor shaped like the weight");
  }
  const bool i32 = int32_indices(indices, offsets);
  const Update u{kind, float(lr), float(weight_decay), float(eps)};
  const int64_t* m = meta.data_ptr<int64_t>();
  for (int64_t t = 0; t < meta.size(0); ++t) {
    TORCH_CHECK(m[t * NCOLS + MODE] != MAX, "xlaunch_nn: the fused backward handles sum and mean pooling, not max");
  }
  auto run = [&](auto index_tag) {
    using I = decltype(index_tag);
    auto in = read_inputs<I>(indices, offsets, per_sample_weights, meta, batch, weight.numel());
    if (bf16) {
      backward_typed(in, table_tensors<uint16_t>(grads, in.tables, batch, weight.scalar_type(), "grad"), u, reinterpret_cast<uint16_t*>(weight.data_ptr()),
                     trail_ptr, state.data_ptr());
    } else {
      backward_typed(in, table_tensors<float>(grads, in.tables, batch, weight.scalar_type(), "grad"), u, weight.data_ptr<float>(),
                     nullptr, state.data_ptr());
    }
  };
  if (i32) run(int32_t{}); else run(int64_t{});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(XLAUNCH_OPS, m) {
  m.def("bag_backward(Tensor[] grads, Tensor[] indices, Tensor[] offsets, Tensor?[] per_sample_weights, "
        "Tensor meta, int batch, int kind, Tensor(a!) weight, Tensor(b!) trail, Tensor(c!) state, "
        "float lr, float weight_decay, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, CPU, m) {  // CPU tensors only: another device's data is never read here
  m.impl("bag_backward", &bag_backward);
}

}  // namespace xlaunch_nn
