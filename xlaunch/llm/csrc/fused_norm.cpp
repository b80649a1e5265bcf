// xlaunch.llm's element-wise fused operators: RMSNorm (with the residual add), SiLU-and-multiply,
// RoPE in place, and the KV-cache writes (with RoPE of the keys on the way). Semantics: the
// pure-torch versions in xlaunch/llm/fused.py. fp32 math, one rounding to the storage dtype per
// stored value (plus the roundings Hugging Face's Llama does: the normed value to x's dtype before the
// weight multiply, silu(gate) to the dtype before the multiply).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fused_vec.h"

namespace xlaunch_llm {
namespace {

constexpr int64_t kSerialElements = 1 << 15;   // below this many elements a call runs on one thread

int64_t grain_for(int64_t per_item) { return std::max<int64_t>(1, kSerialElements / std::max<int64_t>(1, per_item)); }

// --- RMSNorm -------------------------------------------------------------------------------

// out = w * round_T(x * rsqrt(mean(x^2) + eps)) for one row; W is the weight's (and output's) type.
template <typename T, typename W>
inline void norm_row(const T* x, const W* w, W* out, int64_t n, float eps, float sumsq) {
  V16 r = vset(1.0f / std::sqrt(sumsq / float(n) + eps));
  for (int64_t c = 0; c < n; c += kLanes) {
    int m = int(std::min<int64_t>(kLanes, n - c));
    V16 normed = round_to<T>(vload(x + c, m) * r);
    vstore(out + c, vload(w + c, m) * normed, m);
  }
}

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  V16 acc = vzero();
  for (int64_t c = 0; c < n; c += kLanes) {
    int m = int(std::min<int64_t>(kLanes, n - c));
    V16 v = vload(x + c, m);
    acc = fma(v, v, acc);
  }
  return hsum(acc);
}

// residual += x (rounded to T), returns the sum of squares of the new residual.
template <typename T>
inline float add_in_place(T* residual, const T* x, int64_t n) {
  V16 acc = vzero();
  for (int64_t c = 0; c < n; c += kLanes) {
    int m = int(std::min<int64_t>(kLanes, n - c));
    V16 v = round_to<T>(vload(residual + c, m) + vload(x + c, m));
    vstore(residual + c, v, m);
    acc = fma(v, v, acc);
  }
  return hsum(acc);
}

// The weight as the kernel reads it: x's dtype, or fp32 (the output then is fp32 as well).
at::Tensor weight_as_read(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [", x.size(-1), "]");
  at::Tensor w = weight.scalar_type() == x.scalar_type() ? weight : weight.to(at::kFloat);
  return w.contiguous();
}

at::Tensor output_like(const at::Tensor& x, const at::Tensor& weight) {
  return at::empty(x.sizes(), x.options().dtype(at::result_type(x, weight)));
}

void norm_rows(const at::Tensor& input, at::Tensor* residual, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t n = input.size(-1);
  const int64_t rows = n ? input.numel() / n : 0;
  XLAUNCH_LLM_DISPATCH(input.scalar_type(), "xlaunch_llm_rms_norm", [&] {
    using T = scalar_t;
    auto run = [&](auto* wp, auto* op) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
      const T* xp = input.data_ptr<T>();
      T* rp = residual ? residual->data_ptr<T>() : nullptr;
      at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) {
          const T* src = xp + row * n;
          float ss;
          if (rp) {
            ss = add_in_place(rp + row * n, src, n);
            src = rp + row * n;
          } else {
            ss = sum_squares(src, n);
          }
          norm_row<T, W>(src, wp, op + row * n, n, float(eps), ss);
        }
      });
    };
    if (w.scalar_type() == at::kFloat && !std::is_same<T, float>::value) {
      run(w.data_ptr<float>(), out.data_ptr<float>());
    } else {
      run(w.data_ptr<T>(), out.data_ptr<T>());
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor input = x.contiguous();
  at::Tensor out = output_like(x, weight);
  norm_rows(input, nullptr, weight_as_read(x, weight), out, eps);
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm: x and residual must have one shape and dtype");
  at::Tensor input = x.contiguous();
  at::Tensor target = residual.is_contiguous() ? residual : residual.contiguous();
  at::Tensor out = output_like(residual, weight);
  norm_rows(input, &target, weight_as_read(residual, weight), out, eps);
  if (!target.is_same(residual)) residual.copy_(target);
  return out;
}

// --- SiLU and multiply -----------------------------------------------------------------------

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_mul: the last dim must be even");
  at::Tensor input = gate_up.contiguous();
  const int64_t n = input.size(-1) / 2;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, input.options());
  const int64_t rows = n ? out.numel() / n : 0;
  XLAUNCH_LLM_DISPATCH(input.scalar_type(), "xlaunch_llm_silu_mul", [&] {
    using T = scalar_t;
    const T* ip = input.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain_for(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const T* gate = ip + row * 2 * n;
        for (int64_t c = 0; c < n; c += kLanes) {
          int m = int(std::min<int64_t>(kLanes, n - c));
          V16 g = vload(gate + c, m);
          V16 silu = round_to<T>(g / (vset(1.0f) + vexp(vzero() - g)));
          vstore(op + row * n + c, silu * vload(gate + n + c, m), m);
        }
      }
    });
  });
  return out;
}

// --- RoPE and the cache writes -----------------------------------------------------------------

// A [B, S, heads, D] tensor's element pointer and strides (the last dim contiguous).
template <typename T>
struct Heads {
  T* data;
  int64_t sb, ss, sh;
  Heads(const at::Tensor& t) : data(t.data_ptr<T>()), sb(t.stride(0)), ss(t.stride(1)), sh(t.stride(2)) {}
  T* at(int64_t b, int64_t s, int64_t h) const { return data + b * sb + s * ss + h * sh; }
};

// dst = rotate(src) by one position's cos/sin rows (dst may be src).
template <typename T, typename C>
inline void rotate(const T* src, T* dst, const C* cos, const C* sin, int64_t half) {
  for (int64_t c = 0; c < half; c += kLanes) {
    int m = int(std::min<int64_t>(kLanes, half - c));
    V16 x1 = vload(src + c, m), x2 = vload(src + half + c, m);
    V16 o1 = x1 * vload(cos + c, m) - x2 * vload(sin + c, m);
    V16 o2 = fma(x1, vload(sin + half + c, m), x2 * vload(cos + half + c, m));
    vstore(dst + c, o1, m);
    vstore(dst + half + c, o2, m);
  }
}

void check_heads(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, what, " must be [B, S, heads, D] with a contiguous last dim");
}

// The cos/sin tables as [B, S, D] with a contiguous last dim (a batch of 1 broadcast), in x's dtype or fp32.
at::Tensor table(const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == x.size(1) && t.size(2) == x.size(3), "rope: cos/sin must be [B, S, D]");
  at::Tensor r = t.scalar_type() == x.scalar_type() || t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
  if (r.stride(2) != 1) r = r.contiguous();
  return r.expand({x.size(0), x.size(1), x.size(3)});
}

// For every (b, s) row: rotate x's heads in place; with a cache, also rotate k into k_cache[b, :, start + s]
// and copy v into v_cache[b, :, start + s].
void rope_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor* k, const at::Tensor* v,
               at::Tensor* k_cache, at::Tensor* v_cache, int64_t start) {
  check_heads(x, "rope: x");
  at::Tensor c = table(cos, x), s = table(sin, x);
  TORCH_CHECK(c.scalar_type() == s.scalar_type(), "rope: cos and sin must have one dtype");
  const int64_t B = x.size(0), S = x.size(1), NH = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rope: the head size must be even");
  const int64_t G = k ? k->size(2) : 0;
  XLAUNCH_LLM_DISPATCH(x.scalar_type(), "xlaunch_llm_rope", [&] {
    using T = scalar_t;
    auto run = [&](auto* cos_type) {
      using C = std::remove_pointer_t<decltype(cos_type)>;
      const C* cp = c.data_ptr<C>();
      const C* sp = s.data_ptr<C>();
      const int64_t tb = c.stride(0), ts = c.stride(1), ub = s.stride(0), us = s.stride(1);
      Heads<T> xh(x);
      const Heads<T> kh = k ? Heads<T>(*k) : xh, vh = v ? Heads<T>(*v) : xh;
      T* kc = k_cache ? k_cache->data_ptr<T>() : nullptr;
      T* vc = v_cache ? v_cache->data_ptr<T>() : nullptr;
      const int64_t kcb = k_cache ? k_cache->stride(0) : 0, kcg = k_cache ? k_cache->stride(1) : 0,
                    kcl = k_cache ? k_cache->stride(2) : 0, vcb = v_cache ? v_cache->stride(0) : 0,
                    vcg = v_cache ? v_cache->stride(1) : 0, vcl = v_cache ? v_cache->stride(2) : 0;
      at::parallel_for(0, B * S, grain_for((NH + 2 * G) * D), [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) {
          const int64_t b = row / S, t = row % S;
          const C* cr = cp + b * tb + t * ts;
          const C* sr = sp + b * ub + t * us;
          for (int64_t h = 0; h < NH; ++h) rotate<T, C>(xh.at(b, t, h), xh.at(b, t, h), cr, sr, half);
          for (int64_t g = 0; g < G; ++g) {
            T* kdst = kc + b * kcb + g * kcg + (start + t) * kcl;
            T* vdst = vc + b * vcb + g * vcg + (start + t) * vcl;
            rotate<T, C>(kh.at(b, t, g), kdst, cr, sr, half);
            std::memcpy(vdst, vh.at(b, t, g), D * sizeof(T));
          }
        }
      });
    };
    if (c.scalar_type() == at::kFloat && !std::is_same<T, float>::value) run((float*)nullptr); else run((T*)nullptr);
  });
}

void check_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 int64_t start) {
  check_heads(k, "k");
  check_heads(v, "v");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape");
  for (const at::Tensor* cache : {&k_cache, &v_cache}) {
    TORCH_CHECK(cache->dim() == 4 && cache->stride(3) == 1 && cache->size(0) == k.size(0) &&
                    cache->size(1) == k.size(2) && cache->size(3) == k.size(3),
                "the caches must be [B, G, L, D] with a contiguous last dim, k and v [B, S, G, D]");
    TORCH_CHECK(cache->scalar_type() == k.scalar_type() && v.scalar_type() == k.scalar_type(),
                "the caches, k and v must have one dtype");
    TORCH_CHECK(start >= 0 && start + k.size(1) <= cache->size(2), "cache slots ", start, "..", start + k.size(1),
                " exceed its length ", cache->size(2));
  }
}

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  rope_rows(x, cos, sin, nullptr, nullptr, nullptr, nullptr, 0);
}

void rope_write_cache_(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t start) {
  check_cache(k, v, k_cache, v_cache, start);
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must have one dtype");
  rope_rows(q, cos, sin, &k, &v, &k_cache, &v_cache, start);
}

void write_cache_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, int64_t start) {
  check_cache(k, v, k_cache, v_cache, start);
  const int64_t S = k.size(1);
  k_cache.narrow(2, start, S).copy_(k.transpose(1, 2));
  v_cache.narrow(2, start, S).copy_(v.transpose(1, 2));
}

// --- shapes only (fake tensors, torch.compile) ---------------------------------------------------

at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double) { return output_like(x, weight); }

at::Tensor add_rms_norm_meta(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double) {
  return output_like(residual, weight);
}

at::Tensor silu_mul_meta(const at::Tensor& gate_up) {
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() /= 2;
  return at::empty(shape, gate_up.options());
}

void rope_meta(at::Tensor&, const at::Tensor&, const at::Tensor&) {}
void rope_write_cache_meta(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           at::Tensor&, at::Tensor&, int64_t) {}
void write_cache_meta(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {}

}  // namespace

TORCH_LIBRARY_FRAGMENT(XLAUNCH_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("rope_write_cache_(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, int start) -> ()");
  m.def("write_cache_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, int start) -> ()");
}

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("rope_write_cache_", &rope_write_cache_);
  m.impl("write_cache_", &write_cache_);
}

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, Meta, m) {
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("add_rms_norm", &add_rms_norm_meta);
  m.impl("silu_mul", &silu_mul_meta);
  m.impl("rope_", &rope_meta);
  m.impl("rope_write_cache_", &rope_write_cache_meta);
  m.impl("write_cache_", &write_cache_meta);
}

}  // namespace xlaunch_llm
