// RoIAlign (torchvision's semantics) on channels-last images, fp32 or bf16 storage, fp32 math.
//
// The bilinear sampling is separable: a sample at (y, x) reads the rows (y_low, y_high) and the
// columns (x_low, x_high) with weights (hy, ly) x (hx, lx), and it is zero when y or x is outside
// [-1, size]. So each RoI first tabulates its rows and columns once; the forward then sums the four
// corners of every sample per output bin, a whole channel vector per corner (the image must be
// channel stride 1: the Python side converts NCHW inputs once, much cheaper than walking channel
// planes). Other strides, and the output's, are free.
//
// Forward: threads share the RoIs. Backward: threads share the rows of the gradient image (every
// thread walks every RoI and adds only into its own rows), so no two threads add into one element
// and the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace xlaunch_nn {
namespace {

struct Axis {  // one sample coordinate along one axis
  int64_t low, high;
  float w_low, w_high;
  bool valid;
};

// torchvision's bilinear_interpolate, one axis at a time. A NaN coordinate (a box with a NaN or
// infinite corner) and an empty axis have no sample: torchvision converts NaN to an integer and
// reads outside the image there; the pure-torch path (roi_torch.py) skips them too.
Axis interpolate(float v, int64_t size) {
  if (!(v >= -1.0f && v <= float(size)) || size <= 0) return {0, 0, 0.0f, 0.0f, false};
  if (v <= 0) v = 0;
  int64_t low = int64_t(v), high;
  if (low >= size - 1) {
    high = low = size - 1;
    v = float(low);
  } else {
    high = low + 1;
  }
  const float l = v - float(low);
  return {low, high, 1.0f - l, l, true};
}

struct Geometry {
  int64_t pooled_h, pooled_w, sampling;
  float scale;
  bool aligned;
};

struct RoiPlan {  // one RoI's sample rows and columns: ys[ph * grid_h + iy], xs[pw * grid_w + ix]
  int64_t batch, grid_h, grid_w;
  float inv_count;
  std::vector<Axis> ys, xs;
};

// Samples per bin along one axis: ``sampling``, else ceil(extent / bins); none for a box that is
// empty, NaN or too large for an integer (converting those is undefined; the torch path agrees).
int64_t grid_of(float extent, int64_t bins, int64_t sampling) {
  if (sampling > 0) return sampling;
  const float grid = std::ceil(extent / float(bins));
  return grid >= 1.0f && grid < 9.0e18f ? int64_t(grid) : 0;
}

void plan_roi(const float* roi, const Geometry& g, int64_t height, int64_t width, int64_t batches, RoiPlan& plan) {
  plan.batch = int64_t(roi[0]);
  TORCH_CHECK(plan.batch >= 0 && plan.batch < batches && float(plan.batch) == roi[0],
              "roi_align: box batch index ", roi[0], " is not an image index in [0, ", batches, ")");
  const float offset = g.aligned ? 0.5f : 0.0f;
  const float start_w = roi[1] * g.scale - offset, start_h = roi[2] * g.scale - offset;
  const float end_w = roi[3] * g.scale - offset, end_h = roi[4] * g.scale - offset;
  float roi_w = end_w - start_w, roi_h = end_h - start_h;
  if (!g.aligned) {
    roi_w = std::max(roi_w, 1.0f);
    roi_h = std::max(roi_h, 1.0f);
  }
  const float bin_h = roi_h / float(g.pooled_h), bin_w = roi_w / float(g.pooled_w);
  plan.grid_h = grid_of(roi_h, g.pooled_h, g.sampling);
  plan.grid_w = grid_of(roi_w, g.pooled_w, g.sampling);
  plan.inv_count = 1.0f / float(std::max<int64_t>(plan.grid_h * plan.grid_w, 1));
  plan.ys.resize(g.pooled_h * plan.grid_h);
  plan.xs.resize(g.pooled_w * plan.grid_w);
  for (int64_t ph = 0; ph < g.pooled_h; ++ph) {
    for (int64_t iy = 0; iy < plan.grid_h; ++iy) {
      const float y = start_h + float(ph) * bin_h + float(iy + 0.5f) * bin_h / float(plan.grid_h);
      plan.ys[ph * plan.grid_h + iy] = interpolate(y, height);
    }
  }
  for (int64_t pw = 0; pw < g.pooled_w; ++pw) {
    for (int64_t ix = 0; ix < plan.grid_w; ++ix) {
      const float x = start_w + float(pw) * bin_w + float(ix + 0.5f) * bin_w / float(plan.grid_w);
      plan.xs[pw * plan.grid_w + ix] = interpolate(x, width);
    }
  }
}

struct Strides {
  int64_t n, c, h, w;
};

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

template <typename T>
void forward_typed(const T* input, Strides in_s, int64_t batches, int64_t channels, int64_t height, int64_t width,
                   const float* rois, int64_t n_rois, const Geometry& g, T* out, Strides out_s) {
  at::parallel_for(0, n_rois, 1, [&](int64_t k0, int64_t k1) {
    RoiPlan plan;
    std::vector<float> acc(channels);
    for (int64_t k = k0; k < k1; ++k) {
      plan_roi(rois + 5 * k, g, height, width, batches, plan);
      const T* image = input + plan.batch * in_s.n;
      T* dst = out + k * out_s.n;
      for (int64_t ph = 0; ph < g.pooled_h; ++ph) {
        for (int64_t pw = 0; pw < g.pooled_w; ++pw) {
          float* __restrict__ a = acc.data();
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t iy = 0; iy < plan.grid_h; ++iy) {
            const Axis& y = plan.ys[ph * plan.grid_h + iy];
            if (!y.valid) continue;
            for (int64_t ix = 0; ix < plan.grid_w; ++ix) {
              const Axis& x = plan.xs[pw * plan.grid_w + ix];
              if (!x.valid) continue;
              const float w1 = y.w_low * x.w_low, w2 = y.w_low * x.w_high;
              const float w3 = y.w_high * x.w_low, w4 = y.w_high * x.w_high;
              const T* p1 = image + y.low * in_s.h + x.low * in_s.w;
              const T* p2 = image + y.low * in_s.h + x.high * in_s.w;
              const T* p3 = image + y.high * in_s.h + x.low * in_s.w;
              const T* p4 = image + y.high * in_s.h + x.high * in_s.w;
              for (int64_t c = 0; c < channels; ++c) {
                a[c] += w1 * load(p1 + c) + w2 * load(p2 + c) + w3 * load(p3 + c) + w4 * load(p4 + c);
              }
            }
          }
          T* o = dst + ph * out_s.h + pw * out_s.w;
          for (int64_t c = 0; c < channels; ++c) store(o + c * out_s.c, a[c] * plan.inv_count);
        }
      }
    }
  });
}

// Rows of the gradient image a worker owns: bands of kBandRows rows, dealt round-robin. Every
// worker walks every RoI but adds only into its own rows, so each element still receives its
// additions in RoI order (the same result for any thread count) and the workers write disjoint
// memory. (Splitting the channels instead had both cores writing alternate halves of the same
// pixels and measured no faster on two threads than on one.)
constexpr int64_t kBandRows = 4;

template <typename T>
void backward_typed(const T* grad, Strides g_s, const float* rois, int64_t n_rois, const Geometry& g, float* grad_in,
                    Strides gi_s, int64_t batches, int64_t channels, int64_t height, int64_t width) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                  (batches * height + kBandRows - 1) / kBandRows));
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    RoiPlan plan;
    std::vector<float> bin_grad(channels);
    for (int64_t worker = w0; worker < w1; ++worker) {
      for (int64_t k = 0; k < n_rois; ++k) {
        plan_roi(rois + 5 * k, g, height, width, batches, plan);
        auto mine = [&](int64_t y) { return ((plan.batch * height + y) / kBandRows) % workers == worker; };
        float* image = grad_in + plan.batch * gi_s.n;
        const T* gk = grad + k * g_s.n;
        for (int64_t ph = 0; ph < g.pooled_h; ++ph) {
          bool any = false;   // does this row of bins touch one of my rows?
          for (int64_t iy = 0; iy < plan.grid_h && !any; ++iy) {
            const Axis& y = plan.ys[ph * plan.grid_h + iy];
            any = y.valid && (mine(y.low) || mine(y.high));
          }
          if (!any) continue;
          for (int64_t pw = 0; pw < g.pooled_w; ++pw) {
            const T* gb = gk + ph * g_s.h + pw * g_s.w;
            float* __restrict__ gv = bin_grad.data();
            for (int64_t c = 0; c < channels; ++c) gv[c] = load(gb + c * g_s.c) * plan.inv_count;
            for (int64_t iy = 0; iy < plan.grid_h; ++iy) {
              const Axis& y = plan.ys[ph * plan.grid_h + iy];
              if (!y.valid) continue;
              const bool low = mine(y.low), high = mine(y.high);
              if (!low && !high) continue;
              for (int64_t ix = 0; ix < plan.grid_w; ++ix) {
                const Axis& x = plan.xs[pw * plan.grid_w + ix];
                if (!x.valid) continue;
                // The four corners may coincide (clamped at the border): separate loops keep
                // each one's additions in order, as torchvision's four atomic adds.
                if (low) {
                  const float w1 = y.w_low * x.w_low, w2 = y.w_low * x.w_high;
                  float* p1 = image + y.low * gi_s.h + x.low * gi_s.w;
                  float* p2 = image + y.low * gi_s.h + x.high * gi_s.w;
                  for (int64_t c = 0; c < channels; ++c) p1[c] += w1 * gv[c];
                  for (int64_t c = 0; c < channels; ++c) p2[c] += w2 * gv[c];
                }
                if (high) {
                  const float w3 = y.w_high * x.w_low, w4 = y.w_high * x.w_high;
                  float* p3 = image + y.high * gi_s.h + x.low * gi_s.w;
                  float* p4 = image + y.high * gi_s.h + x.high * gi_s.w;
                  for (int64_t c = 0; c < channels; ++c) p3[c] += w3 * gv[c];
                  for (int64_t c = 0; c < channels; ++c) p4[c] += w4 * gv[c];
                }
              }
            }
          }
        }
      }
    }
  });
}

void check_channels_last(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.size(1) == 1 || t.stride(1) == 1,
              "roi_align: ", what, "'s channels must be contiguous (x.contiguous(memory_format=torch.channels_last))");
}

Geometry geometry(double spatial_scale, int64_t pooled_h, int64_t pooled_w, int64_t sampling, bool aligned) {
  TORCH_CHECK(pooled_h > 0 && pooled_w > 0, "roi_align: output_size must be positive, got (", pooled_h, ", ", pooled_w, ")");
  return {pooled_h, pooled_w, sampling, float(spatial_scale), aligned};
}

void check_rois(const at::Tensor& rois) {
  TORCH_CHECK(rois.dim() == 2 && rois.size(1) == 5 && rois.scalar_type() == at::kFloat && rois.is_contiguous(),
              "roi_align: rois must be a contiguous float32 (K, 5) tensor");
}

void roi_align_forward(const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_h,
                       int64_t pooled_w, int64_t sampling, bool aligned, at::Tensor& out) {
  TORCH_CHECK(input.dim() == 4 && out.dim() == 4 && input.scalar_type() == out.scalar_type(),
              "roi_align: input and out must be 4-D tensors of one dtype");
  check_rois(rois);
  const Geometry g = geometry(spatial_scale, pooled_h, pooled_w, sampling, aligned);
  TORCH_CHECK(out.size(0) == rois.size(0) && out.size(1) == input.size(1) && out.size(2) == pooled_h && out.size(3) == pooled_w,
              "roi_align: out has the wrong shape");
  check_channels_last(input, "input");
  const int64_t n = input.size(0), c = input.size(1), h = input.size(2), w = input.size(3);
  if (input.scalar_type() == at::kBFloat16) {
    forward_typed(reinterpret_cast<const uint16_t*>(input.data_ptr()), strides_of(input), n, c, h, w, rois.data_ptr<float>(),
                  rois.size(0), g, reinterpret_cast<uint16_t*>(out.data_ptr()), strides_of(out));
  } else {
    TORCH_CHECK(input.scalar_type() == at::kFloat, "roi_align: input must be float32 or bfloat16");
    forward_typed(input.data_ptr<float>(), strides_of(input), n, c, h, w, rois.data_ptr<float>(), rois.size(0), g,
                  out.data_ptr<float>(), strides_of(out));
  }
}

void roi_align_backward(const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_h,
                        int64_t pooled_w, int64_t sampling, bool aligned, at::Tensor& grad_input) {
  TORCH_CHECK(grad.dim() == 4 && grad_input.dim() == 4 && grad_input.scalar_type() == at::kFloat,
              "roi_align: grad must be 4-D and grad_input a 4-D float32 tensor");
  check_rois(rois);
  const Geometry g = geometry(spatial_scale, pooled_h, pooled_w, sampling, aligned);
  TORCH_CHECK(grad.size(0) == rois.size(0) && grad.size(1) == grad_input.size(1) && grad.size(2) == pooled_h &&
              grad.size(3) == pooled_w, "roi_align: grad has the wrong shape");
  check_channels_last(grad_input, "grad_input");
  const int64_t n = grad_input.size(0), c = grad_input.size(1), h = grad_input.size(2), w = grad_input.size(3);
  if (grad.scalar_type() == at::kBFloat16) {
    backward_typed(reinterpret_cast<const uint16_t*>(grad.data_ptr()), strides_of(grad), rois.data_ptr<float>(), rois.size(0),
                   g, grad_input.data_ptr<float>(), strides_of(grad_input), n, c, h, w);
  } else {
    TORCH_CHECK(grad.scalar_type() == at::kFloat, "roi_align: grad must be float32 or bfloat16");
    backward_typed(grad.data_ptr<float>(), strides_of(grad), rois.data_ptr<float>(), rois.size(0), g,
                   grad_input.data_ptr<float>(), strides_of(grad_input), n, c, h, w);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(XLAUNCH_OPS, m) {
  m.def("roi_align_forward(Tensor input, Tensor rois, float spatial_scale, int pooled_height, int pooled_width, "
        "int sampling_ratio, bool aligned, Tensor(a!) out) -> ()");
  m.def("roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, int pooled_height, int pooled_width, "
        "int sampling_ratio, bool aligned, Tensor(a!) grad_input) -> ()");
}

// CPU tensors only (another device's data pointer is never read here); on meta and fake tensors
// (torch.compile's tracing) the operators write nothing, so a compiled graph can hold them.
TORCH_LIBRARY_IMPL(XLAUNCH_OPS, CPU, m) {
  m.impl("roi_align_forward", &roi_align_forward);
  m.impl("roi_align_backward", &roi_align_backward);
}

TORCH_LIBRARY_IMPL(XLAUNCH_OPS, Meta, m) {
  m.impl("roi_align_forward", [](const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, int64_t, bool,
                                 at::Tensor&) {});
  m.impl("roi_align_backward", [](const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, int64_t, bool,
                                  at::Tensor&) {});
}

}  // namespace xlaunch_nn
