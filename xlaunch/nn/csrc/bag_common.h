// What the merged-embedding-bag kernels share: the per-table description (`meta`, one int64 row
// per table: see the Col enum) and the checked view of one call's inputs.
//
// Table t's rows are a (rows, dim) block at element weight_offset[t] of one flat weight storage;
// its output (and upstream gradient) is outs[t], where bag b starts at element
// out_offset[t] + b * out_stride[t]: one tensor per table, or one (batch, width) matrix passed once
// per table with column offsets.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace xlaunch_nn {

enum Col { WEIGHT_OFFSET = 0, ROWS, DIM, MODE, OUT_OFFSET, OUT_STRIDE, ROW_BASE, NCOLS };
enum Mode { SUM = 0, MEAN = 1, MAX = 2 };
enum Kind { WRITE_GRAD = 0, SGD = 1, ADAGRAD = 2 };

constexpr int kPrefetchAhead = 8;  // lookups ahead: measured 4, 8 and 16 here, 8 as good as any

struct Table {
  int64_t weight_offset, rows, dim, mode, out_offset, out_stride, row_base;
  int64_t n_indices, n_offsets, n_lookups;  // lookups: indices that fall in a bag
};

template <typename I>
struct Inputs {
  std::vector<Table> tables;
  std::vector<const I*> indices, offsets;
  std::vector<const void*> weights;  // per-sample weights or nullptr
  int64_t batch = 0, max_dim = 0;

  int64_t bag_begin(int64_t t, int64_t b) const { return offsets[t][b]; }
  int64_t bag_end(int64_t t, int64_t b) const {
    return b + 1 < tables[t].n_offsets ? int64_t(offsets[t][b + 1]) : tables[t].n_indices;
  }
};

// Reads the per-table description and checks what a bad input could turn into a wild read.
template <typename I>
Inputs<I> read_inputs(const at::TensorList& indices, const at::TensorList& offsets,
                      const c10::List<std::optional<at::Tensor>>& per_sample_weights,
                      const at::Tensor& meta, int64_t batch, int64_t weight_numel) {
  const int64_t n = meta.size(0);
  TORCH_CHECK(meta.dim() == 2 && meta.size(1) == NCOLS && meta.scalar_type() == at::kLong && meta.is_contiguous(),
              "xlaunch_nn: meta must be a contiguous int64 (tables, ", int(NCOLS), ") tensor");
  TORCH_CHECK(int64_t(indices.size()) == n && int64_t(offsets.size()) == n && int64_t(per_sample_weights.size()) == n,
              "xlaunch_nn: one indices, offsets and per_sample_weights entry per table");
  Inputs<I> in;
  in.batch = batch;
  const int64_t* m = meta.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t, m += NCOLS) {
    const at::Tensor& idx = indices[t];
    const at::Tensor& off = offsets[t];
    TORCH_CHECK(idx.dim() == 1 && idx.is_contiguous() && off.dim() == 1 && off.is_contiguous(),
                "xlaunch_nn: indices and offsets must be contiguous 1-D tensors (table ", t, ")");
    Table tab{m[WEIGHT_OFFSET], m[ROWS], m[DIM], m[MODE], m[OUT_OFFSET], m[OUT_STRIDE], m[ROW_BASE],
              idx.numel(), off.numel(), 0};
    TORCH_CHECK(tab.n_offsets == batch || tab.n_offsets == batch + 1,
                "xlaunch_nn: table ", t, " has ", tab.n_offsets, " offsets for a batch of ", batch);
    TORCH_CHECK(tab.weight_offset >= 0 && tab.rows >= 0 && tab.dim > 0 &&
                tab.weight_offset + tab.rows * tab.dim <= weight_numel,
                "xlaunch_nn: table ", t, " does not fit in the weight storage");
    const I* o = off.data_ptr<I>();
    TORCH_CHECK(batch == 0 || o[0] == 0, "offsets[0] has to be 0 (table ", t, "), got ", int64_t(o[0]));
    for (int64_t b = 1; b < tab.n_offsets; ++b) {
      TORCH_CHECK(o[b] >= o[b - 1], "offsets must not decrease (table ", t, ", position ", b, ")");
    }
    TORCH_CHECK(tab.n_offsets == 0 || int64_t(o[tab.n_offsets - 1]) <= tab.n_indices,
                "the last offset of table ", t, " is past its ", tab.n_indices, " indices");
    tab.n_lookups = batch == 0 ? 0 : (tab.n_offsets > batch ? int64_t(o[batch]) : tab.n_indices);
    in.tables.push_back(tab);
    in.indices.push_back(idx.data_ptr<I>());
    in.offsets.push_back(o);
    const auto& psw = per_sample_weights.get(t);
    if (psw.has_value() && psw->defined()) {
      TORCH_CHECK(psw->is_contiguous() && psw->numel() == tab.n_indices,
                  "per_sample_weights of table ", t, " must be contiguous with one weight per index");
      in.weights.push_back(psw->data_ptr());
    } else {
      in.weights.push_back(nullptr);
    }
    in.max_dim = std::max(in.max_dim, tab.dim);
  }
  return in;
}

template <typename I>
[[noreturn]] inline void bad_index(int64_t t, int64_t j, I value, int64_t rows) {
  TORCH_CHECK(false, "index ", int64_t(value), " at position ", j, " of table ", t, " is out of range [0, ", rows, ")");
}

// Each table's output (or upstream gradient) tensor, checked to hold all of its bags.
template <typename W>
std::vector<W*> table_tensors(at::TensorList tensors, const std::vector<Table>& tables, int64_t batch,
                              at::ScalarType dtype, const char* what) {
  TORCH_CHECK(tensors.size() == tables.size(), "xlaunch_nn: one ", what, " tensor per table");
  std::vector<W*> pointers;
  for (size_t t = 0; t < tables.size(); ++t) {
    const at::Tensor& x = tensors[t];
    const Table& tab = tables[t];
    TORCH_CHECK(x.scalar_type() == dtype && x.is_contiguous(), "xlaunch_nn: ", what, " of table ", t,
                " must be contiguous and of the weights' dtype");
    TORCH_CHECK(batch == 0 || (tab.out_offset >= 0 && tab.out_stride >= tab.dim &&
                               tab.out_offset + (batch - 1) * tab.out_stride + tab.dim <= x.numel()),
                "xlaunch_nn: ", what, " of table ", t, " is too small for its bags");
    pointers.push_back(reinterpret_cast<W*>(x.data_ptr()));
  }
  return pointers;
}

template <typename W>
inline void prefetch_row(const W* row, int64_t dim, int rw = 0) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < int64_t(dim * sizeof(W)); line += 64) {
    if (rw) __builtin_prefetch(p + line, 1); else __builtin_prefetch(p + line);
  }
}

// Whether every table's indices and offsets are int32 (else all must be int64).
inline bool int32_indices(at::TensorList indices, at::TensorList offsets) {
  const bool i32 = !indices.empty() && indices[0].scalar_type() == at::kInt;
  TORCH_CHECK(indices.size() == offsets.size(), "xlaunch_nn: one offsets tensor per indices tensor");
  for (size_t t = 0; t < indices.size(); ++t) {
    TORCH_CHECK(indices[t].scalar_type() == (i32 ? at::kInt : at::kLong) && offsets[t].scalar_type() == indices[t].scalar_type(),
                "xlaunch_nn: all indices and offsets must share one dtype, int32 or int64");
  }
  return i32;
}

}  // namespace xlaunch_nn
