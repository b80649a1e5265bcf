// xlaunch.llm's attention over a preallocated KV cache: S new query tokens (positions start ..
// start+S-1) against the cache's first start+S slots, causal, GQA, an optional key padding mask.
// The cache is read in place (no copies of K/V, nothing allocated in proportion to it) with an
// online softmax in fp32. Work items: (batch, KV head, block of up to 4 query rows, key split); the
// query rows of one KV head (its S tokens x H/G heads) share each key and value load. When batch x
// KV heads x row blocks leaves threads idle, the keys are split as well (flash-decoding) and the
// partial softmax states combined at the end. Semantics: cache_attention in xlaunch/llm/fused.py
// (a query row with every key masked gives zeros).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "fused_vec.h"

namespace xlaunch_llm {
namespace {

constexpr int kRows = 4;             // query rows per work item
constexpr int kKeys = 64;            // keys per softmax block
constexpr int kMaxHead = 512;        // the largest head size
constexpr int64_t kMinSplit = 256;   // the fewest keys a split gets
constexpr int64_t kSerialWork = 1 << 16;  // below this many row x key x D products: one thread

template <typename T>
struct Problem {
  const T *q, *k, *v;
  const bool* pad;
  int64_t qb, qs, qh;        // q strides (batch, token, head)
  int64_t kb, kg, kl;        // k_cache strides
  int64_t vb, vg, vl;        // v_cache strides
  int64_t pb;                // key_padding batch stride
  int64_t S, H, G, D, start, total, blocks, splits;
  float scale;
};

// The softmax state of one row block over a key range: running max, sum of exponentials, sum of
// exponential-weighted values.
struct State {
  float m[kRows], l[kRows];
  alignas(64) float acc[kRows][kMaxHead];
};

// Lanes of the 16-float chunk starting at column col of a D-wide row (0 past its end).
inline int lanes(int64_t D, int64_t col) { return int(std::max<int64_t>(0, std::min<int64_t>(kLanes, D - col))); }

// Head dims go in groups of 4 chunks (64 floats), so that the R rows' accumulators of a group stay
// in registers; R (the rows of the block) is a compile-time count for the same reason.
template <typename T, int R>
void attend_rows(const Problem<T>& p, int64_t b, int64_t g, int64_t row0, int64_t key0, int64_t key1, State& st) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t hpg = p.H / p.G, D = p.D;
  alignas(64) float q[R][kMaxHead];
  int64_t limit[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + r, token = row / hpg, head = g * hpg + row % hpg;
    const T* src = p.q + b * p.qb + token * p.qs + head * p.qh;
    for (int64_t col = 0; col < D; col += kLanes) vstore(q[r] + col, vload(src + col, lanes(D, col)) * vset(p.scale));
    limit[r] = p.start + token;  // the last key this row sees
    st.m[r] = kNegInf;
    st.l[r] = 0.0f;
    for (int64_t col = 0; col < D; col += kLanes) vstore(st.acc[r] + col, vzero());
  }
  key1 = std::min(key1, limit[R - 1] + 1);
  const T* kbase = p.k + b * p.kb + g * p.kg;
  const T* vbase = p.v + b * p.vb + g * p.vg;
  const bool* pad = p.pad ? p.pad + b * p.pb : nullptr;
  alignas(64) float s[R][kKeys + kLanes];
  for (int64_t j0 = key0; j0 < key1; j0 += kKeys) {
    const int nk = int(std::min<int64_t>(kKeys, key1 - j0));
    // scores of the block's keys
    for (int j = 0; j < nk; ++j) {
      const T* kr = kbase + (j0 + j) * p.kl;
      V16 dot[R];
      for (int r = 0; r < R; ++r) dot[r] = vzero();
      for (int64_t col = 0; col < D; col += kLanes) {
        V16 kv = vload(kr + col, lanes(D, col));
        for (int r = 0; r < R; ++r) dot[r] = fma(vload(q[r] + col), kv, dot[r]);
      }
      const bool masked = pad && pad[j0 + j];
      for (int r = 0; r < R; ++r) s[r][j] = masked || j0 + j > limit[r] ? kNegInf : hsum(dot[r]);
    }
    // online softmax: scores -> probabilities against the running max, rescale what was summed so far
    bool any = false;
    for (int r = 0; r < R; ++r) {
      for (int j = nk; j < kKeys + kLanes; ++j) s[r][j] = kNegInf;
      V16 mx = vset(kNegInf);
      for (int j = 0; j < nk; j += kLanes) mx = vmax(mx, vload(s[r] + j));
      const float block_max = hmax(mx);
      if (block_max == kNegInf) {
        for (int j = 0; j < nk; ++j) s[r][j] = 0.0f;
        continue;
      }
      const float m_new = std::max(st.m[r], block_max);
      const float alpha = std::exp(st.m[r] - m_new);
      V16 sum = vzero();
      for (int j = 0; j < nk; j += kLanes) {
        V16 e = vexp(vload(s[r] + j) - vset(m_new));
        vstore(s[r] + j, e);
        sum = sum + e;
      }
      st.l[r] = st.l[r] * alpha + hsum(sum);
      st.m[r] = m_new;
      if (alpha != 1.0f)
        for (int64_t col = 0; col < D; col += kLanes) vstore(st.acc[r] + col, vload(st.acc[r] + col) * vset(alpha));
      any = true;
    }
    if (!any) continue;
    // values, 64 dims at a time
    for (int64_t c0 = 0; c0 < D; c0 += 4 * kLanes) {
      V16 acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = vload(st.acc[r] + c0 + c * kLanes);
      for (int j = 0; j < nk; ++j) {
        const T* vr = vbase + (j0 + j) * p.vl + c0;
        for (int c = 0; c < 4; ++c) {
          V16 vv = vload(vr + c * kLanes, lanes(D, c0 + c * kLanes));
          for (int r = 0; r < R; ++r) acc[r][c] = fma(vset(s[r][j]), vv, acc[r][c]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) vstore(st.acc[r] + c0 + c * kLanes, acc[r][c]);
    }
  }
}

template <typename T>
void attend(const Problem<T>& p, int64_t b, int64_t g, int64_t row0, int rows, int64_t key0, int64_t key1,
            State& st) {
  switch (rows) {
    case 1: return attend_rows<T, 1>(p, b, g, row0, key0, key1, st);
    case 2: return attend_rows<T, 2>(p, b, g, row0, key0, key1, st);
    case 3: return attend_rows<T, 3>(p, b, g, row0, key0, key1, st);
    default: return attend_rows<T, 4>(p, b, g, row0, key0, key1, st);
  }
}

// out row = acc / l (zeros when every key was masked).
template <typename T>
inline void finish_row(const float* acc, float l, T* out, int64_t D) {
  V16 inv = vset(l > 0.0f ? 1.0f / l : 0.0f);
  for (int64_t c = 0; c < D; c += kLanes) {
    int n = int(std::min<int64_t>(kLanes, D - c));
    vstore(out + c, vload(acc + c) * inv, n);
  }
}

template <typename T>
void run(const Problem<T>& p, int64_t B, T* out) {
  const int64_t hpg = p.H / p.G, rows_total = p.S * hpg, D = p.D;
  const int64_t items = B * p.G * p.blocks * p.splits;
  const int64_t per_item = std::max<int64_t>(1, kRows * (p.total / p.splits) * D);
  const int64_t grain = std::max<int64_t>(1, kSerialWork / per_item);
  const int64_t split_len = (p.total + p.splits - 1) / p.splits;
  // Partial states when the keys are split: [item] -> (m, l, acc[D]) per row.
  std::vector<float> partial(p.splits > 1 ? items * kRows * (D + 2) : 0);
  auto out_row = [&](int64_t b, int64_t g, int64_t row) {
    const int64_t token = row / hpg, head = g * hpg + row % hpg;
    return out + ((b * p.S + token) * p.H + head) * D;
  };
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    State st;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t split = item % p.splits, rest = item / p.splits;
      const int64_t block = rest % p.blocks, bg = rest / p.blocks, b = bg / p.G, g = bg % p.G;
      const int64_t row0 = block * kRows;
      const int rows = int(std::min<int64_t>(kRows, rows_total - row0));
      attend(p, b, g, row0, rows, split * split_len, std::min(p.total, (split + 1) * split_len), st);
      for (int r = 0; r < rows; ++r) {
        if (p.splits == 1) {
          finish_row(st.acc[r], st.l[r], out_row(b, g, row0 + r), D);
        } else {
          float* dst = partial.data() + (item * kRows + r) * (D + 2);
          dst[0] = st.m[r];
          dst[1] = st.l[r];
          std::memcpy(dst + 2, st.acc[r], D * sizeof(float));
        }
      }
    }
  });
  if (p.splits == 1) return;
  at::parallel_for(0, B * p.G * p.blocks, std::max<int64_t>(1, grain * p.splits), [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxHead];
    for (int64_t rest = begin; rest < end; ++rest) {
      const int64_t block = rest % p.blocks, bg = rest / p.blocks, b = bg / p.G, g = bg % p.G;
      const int64_t row0 = block * kRows;
      const int rows = int(std::min<int64_t>(kRows, rows_total - row0));
      for (int r = 0; r < rows; ++r) {
        float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
        for (int64_t sp = 0; sp < p.splits; ++sp) m = std::max(m, partial[((rest * p.splits + sp) * kRows + r) * (D + 2)]);
        std::fill(acc, acc + D, 0.0f);
        if (m != -std::numeric_limits<float>::infinity()) {
          for (int64_t sp = 0; sp < p.splits; ++sp) {
            const float* src = partial.data() + ((rest * p.splits + sp) * kRows + r) * (D + 2);
            if (src[1] == 0.0f) continue;
            const float w = std::exp(src[0] - m);
            l += w * src[1];
            for (int64_t d = 0; d < D; ++d) acc[d] += w * src[2 + d];
          }
        }
        finish_row(acc, l, out_row(b, g, row0 + r), D);
      }
    }
  });
}

void check(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t start,
           const c10::optional<at::Tensor>& key_padding) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "cache_attention: q must be [B, S, H, D], the caches [B, G, L, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "cache_attention: k_cache and v_cache must have one shape");
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3), G = k_cache.size(1);
  TORCH_CHECK(k_cache.size(0) == B && k_cache.size(3) == D && G > 0 && H % G == 0,
              "cache_attention: the caches must be [B, G, L, D] with H % G == 0");
  TORCH_CHECK(start >= 0 && start + S <= k_cache.size(2), "cache_attention: positions ", start, "..", start + S,
              " exceed the cache length ", k_cache.size(2));
  if (key_padding) {
    TORCH_CHECK(key_padding->dim() == 2 && key_padding->size(0) == B && key_padding->size(1) >= start + S,
                "cache_attention: key_padding must be [B, start + S]");
  }
}

at::Tensor cache_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, int64_t start,
                           const c10::optional<at::Tensor>& key_padding, double scale) {
  check(q_in, k_in, v_in, start, key_padding);
  TORCH_CHECK(q_in.scalar_type() == k_in.scalar_type() && k_in.scalar_type() == v_in.scalar_type(),
              "cache_attention: q and the caches must have one dtype");
  TORCH_CHECK(q_in.size(3) <= kMaxHead, "cache_attention: head size above ", kMaxHead);
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  at::Tensor pad;
  if (key_padding) pad = key_padding->to(at::kBool).narrow(1, 0, start + q.size(1)).contiguous();
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3), G = k.size(1);
  at::Tensor out = at::empty({B, S, H * D}, q.options());
  if (out.numel() == 0) return out;
  XLAUNCH_LLM_DISPATCH(q.scalar_type(), "xlaunch_llm_cache_attention", [&] {
    Problem<scalar_t> p;
    p.q = q.data_ptr<scalar_t>();
    p.k = k.data_ptr<scalar_t>();
    p.v = v.data_ptr<scalar_t>();
    p.pad = pad.defined() ? pad.data_ptr<bool>() : nullptr;
    p.qb = q.stride(0), p.qs = q.stride(1), p.qh = q.stride(2);
    p.kb = k.stride(0), p.kg = k.stride(1), p.kl = k.stride(2);
    p.vb = v.stride(0), p.vg = v.stride(1), p.vl = v.stride(2);
    p.pb = pad.defined() ? pad.stride(0) : 0;
    p.S = S, p.H = H, p.G = G, p.D = D, p.start = start, p.total = start + S;
    p.blocks = (S * (H / G) + kRows - 1) / kRows;
    p.scale = float(scale);
    const int64_t threads = at::get_num_threads(), base = B * G * p.blocks;
    p.splits = 1;
    if (base < threads && p.total >= 2 * kMinSplit)
      p.splits = std::min((threads + base - 1) / base, p.total / kMinSplit);
    run(p, B, out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor cache_attention_meta(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                int64_t start, const c10::optional<at::Tensor>& key_padding, double) {
  return at::empty({q.size(0), q.size(1), q.size(2) * q.size(3)}, q.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(XLAUNCH_OPS, m) {
  m.def("cache_attention(Tensor q, Tensor k_cache, Tensor v_cache, int start, Tensor? key_padding, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, CPU, m) { m.impl("cache_attention", &cache_attention); }

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, Meta, m) { m.impl("cache_attention", &cache_attention_meta); }

}  // namespace xlaunch_llm
