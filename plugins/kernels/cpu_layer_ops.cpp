// Fused element-wise ops of a Llama decoder layer for the CPU, offered by the `cpu-paged`
// backend as its `layer_ops`: RMSNorm (plain, and with the residual add folded in), rotary
// embedding in place, and SiLU-and-multiply. Each replaces several torch ops (and their
// Python dispatch and temporaries) with one pass over the rows.
//
// Rounding follows the torch reference path wherever the order of operations allows: values
// are widened to float32, element-wise products and sums round as torch's do, and a
// half-precision result is rounded once, as torch's casts do. RMSNorm's sum of squares
// accumulates in its own order, and SiLU's exponential is this file's own.
#include "cpu_kernels.h"

#include <cmath>

#include "cpu_simd.h"

namespace {

constexpr int64_t kRowsPerTask = 16;  // small batches stay on one thread: waking the pool costs more

template <typename scalar_t>
inline float widen(scalar_t value) { return static_cast<float>(value); }

// out[row] = weight * normalised(x[row]): float32 statistics, then (for half precision) the
// normalised row is rounded to the input dtype before the weight multiplies it, as in HF Llama.
template <typename scalar_t>
inline void normalise_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t hidden, float eps) {
  float lanes[16] = {};  // sixteen independent sums: the compiler keeps them in one vector
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16)
    for (int l = 0; l < 16; ++l) {
      const float v = widen(x[i + l]);
      lanes[l] += v * v;
    }
  float sum = 0.f;
  for (; i < hidden; ++i) {
    const float v = widen(x[i]);
    sum += v * v;
  }
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  const float inverse = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  i = 0;
#ifdef __AVX2__
  if constexpr (servelab_simd::kStores<scalar_t>) {
    using S = servelab_simd::Native;
    for (; i + S::kWidth <= hidden; i += S::kWidth)
      S::store(out + i, S::mul(S::load(weight + i), S::rounded(S::mul(S::load(x + i), S::set1(inverse)), x)));
  }
#endif
  for (; i < hidden; ++i) {
    const scalar_t normalised = static_cast<scalar_t>(widen(x[i]) * inverse);
    out[i] = static_cast<scalar_t>(widen(weight[i]) * widen(normalised));
  }
}

template <typename scalar_t>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const scalar_t* x_data = x.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalise_row(x_data + r * hidden, w, o + r * hidden, hidden, eps);
  });
}

// residual += x; x = rms_norm(residual): the residual stream and the next norm in one pass.
template <typename scalar_t>
void add_rms_norm_kernel(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  scalar_t* x_data = x.data_ptr<scalar_t>();
  scalar_t* res = residual.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = x_data + r * hidden;
      scalar_t* rr = res + r * hidden;
      int64_t i = 0;
#ifdef __AVX2__
      if constexpr (servelab_simd::kStores<scalar_t>) {
        using S = servelab_simd::Native;
        for (; i + S::kWidth <= hidden; i += S::kWidth) S::store(rr + i, S::add(S::load(rr + i), S::load(xr + i)));
      }
#endif
      for (; i < hidden; ++i) rr[i] = static_cast<scalar_t>(widen(rr[i]) + widen(xr[i]));
      normalise_row(rr, w, xr, hidden, eps);
    }
  });
}

// Rotates the first `num_heads` heads of each row of `qkv` in place (half-rotation layout):
// x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin, with cos/sin of the row's position.
template <typename scalar_t>
void rotary_kernel(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t num_heads, int64_t head_dim) {
  const int64_t rows = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  scalar_t* data = qkv.data_ptr<scalar_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const scalar_t* cos_data = cos.data_ptr<scalar_t>();
  const scalar_t* sin_data = sin.data_ptr<scalar_t>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* c = cos_data + pos[r] * half;
      const scalar_t* s = sin_data + pos[r] * half;
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* x = data + r * row_stride + h * head_dim;
        int64_t i = 0;
#ifdef __AVX2__
        if constexpr (servelab_simd::kStores<scalar_t>) {
          using S = servelab_simd::Native;
          for (; i + S::kWidth <= half; i += S::kWidth) {  // the scalar loop's roundings, lane by lane
            const S::V x1 = S::load(x + i), x2 = S::load(x + i + half), ci = S::load(c + i), si = S::load(s + i);
            const S::V a = S::rounded(S::mul(x1, ci), x), b = S::rounded(S::mul(x2, S::mul(si, S::set1(-1.f))), x);
            const S::V d = S::rounded(S::mul(x2, ci), x), e = S::rounded(S::mul(x1, si), x);
            S::store(x + i, S::add(a, b));
            S::store(x + i + half, S::add(d, e));
          }
        }
#endif
        for (; i < half; ++i) {
          const float x1 = widen(x[i]), x2 = widen(x[i + half]), ci = widen(c[i]), si = widen(s[i]);
          // The reference rounds each product to the dtype, then the sum: keep that order.
          const scalar_t a = static_cast<scalar_t>(x1 * ci), b = static_cast<scalar_t>(x2 * -si);
          const scalar_t d = static_cast<scalar_t>(x2 * ci), e = static_cast<scalar_t>(x1 * si);
          x[i] = static_cast<scalar_t>(widen(a) + widen(b));
          x[i + half] = static_cast<scalar_t>(widen(d) + widen(e));
        }
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_kernel(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1);
  const scalar_t* in = gate_up.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = in + r * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* target = o + r * width;
      int64_t i = 0;
#ifdef __AVX2__
      using S = servelab_simd::Native;
      for (; i + S::kWidth <= width; i += S::kWidth) {  // silu(g) = g / (1 + e^-g), rounded to the dtype, times up
        const S::V g = S::load(gate + i);
        const S::V silu = S::div(g, S::add(S::set1(1.f), servelab_simd::exp<S>(S::sub(S::zero(), g))));
        if constexpr (servelab_simd::kStores<scalar_t>) {
          S::store(target + i, S::mul(S::rounded(silu, target), S::load(up + i)));
        } else {
          float activated[S::kWidth];
          S::storeu(activated, silu);
          for (int l = 0; l < S::kWidth; ++l)
            target[i + l] = static_cast<scalar_t>(widen(static_cast<scalar_t>(activated[l])) * widen(up[i + l]));
        }
      }
#endif
      for (; i < width; ++i) {
        const float g = widen(gate[i]);
        const scalar_t activated = static_cast<scalar_t>(g / (1.f + std::exp(-g)));
        target[i] = static_cast<scalar_t>(widen(activated) * widen(up[i]));
      }
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name, " must be a 2-D CPU tensor with contiguous rows");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm needs contiguous x and weight of one dtype");
  at::Tensor out = at::empty_like(x);
  DISPATCH_MODEL_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.view({-1, x.size(-1)}), weight, out, eps);
  });
  return out;
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm_ needs contiguous tensors");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "add_rms_norm_ needs one dtype");
  DISPATCH_MODEL_TYPES(x.scalar_type(), "add_rms_norm_", [&] {
    at::Tensor x2 = x.view({-1, x.size(-1)}), r2 = residual.view({-1, x.size(-1)});
    add_rms_norm_kernel<scalar_t>(x2, r2, weight, eps);
  });
}

void rotary_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
             int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
              sin.scalar_type() == qkv.scalar_type(), "cos/sin tables must be contiguous and of qkv's dtype");
  TORCH_CHECK(num_heads * head_dim <= qkv.size(1), "more rotated heads than the row holds");
  DISPATCH_MODEL_TYPES(qkv.scalar_type(), "rotary_", [&] {
    rotary_kernel<scalar_t>(qkv, positions, cos, sin, num_heads, head_dim);
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2, "silu_and_mul needs a contiguous [T, 2 * I] tensor");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul_out(gate_up, out);
  return out;
}

void silu_and_mul_out(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "silu_and_mul needs a contiguous [T, 2 * I] tensor");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == gate_up.size(0) &&
                  out.size(1) * 2 == gate_up.size(1) && out.scalar_type() == gate_up.scalar_type(),
              "silu_and_mul's output must be a contiguous [T, I] tensor of the input's dtype");
  DISPATCH_MODEL_TYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(gate_up, out);
  });
}
