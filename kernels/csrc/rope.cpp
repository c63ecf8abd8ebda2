// Rotary position embedding in one pass: out = x cos + rotate_half(x) sin per element, two fp32 products and one
// fp32 sum (no fused multiply-add: -ffp-contract=off), rounded once to x's dtype: the bits of the torch ops
// `(x32 * cos + cat(-x32[half:], x32[:half]) * sin).to(x.dtype)`, which took six passes over fp32 temporaries.
// Elementwise, so no row depends on another.

#include "rounding.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>

namespace {

using logdiff::has_avx512;
using logdiff::narrow;
using logdiff::widen;

// Tokens [begin, end) of x [N, H, D] (token stride xt, head stride xh, D contiguous) into out [N, H, D] contiguous.
template <typename T>
__attribute__((always_inline)) inline void rotate(const T* x, int64_t xt, int64_t xh, const float* cos,
                                                  const float* sin, int64_t H, int64_t D, T* out, int64_t begin,
                                                  int64_t end) {
  const int64_t half = D / 2;
  for (int64_t n = begin; n < end; ++n) {
    const float* c = cos + n * D;
    const float* s = sin + n * D;
    for (int64_t h = 0; h < H; ++h) {
      const T* v = x + n * xt + h * xh;
      T* o = out + (n * H + h) * D;
      for (int64_t i = 0; i < half; ++i) narrow(widen(v[i]) * c[i] + -widen(v[i + half]) * s[i], o + i);
      for (int64_t i = half; i < D; ++i) narrow(widen(v[i]) * c[i] + widen(v[i - half]) * s[i], o + i);
    }
  }
}

template <typename T>
__attribute__((target("avx512f,avx512bw"))) void rotate_avx512(const T* x, int64_t xt, int64_t xh, const float* cos,
                                                                 const float* sin, int64_t H, int64_t D, T* out,
                                                                 int64_t begin, int64_t end) {
  rotate(x, xt, xh, cos, sin, H, D, out, begin, end);
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  const T* xp = x.data_ptr<T>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * D, 1)), [&](int64_t begin, int64_t end) {
    if (has_avx512()) rotate_avx512(xp, x.stride(0), x.stride(1), cp, sp, H, D, op, begin, end);
    else rotate(xp, x.stride(0), x.stride(1), cp, sp, H, D, op, begin, end);
  });
}

// x [N, H, D] (fp32, bf16 or fp16; D contiguous), cos and sin [N, D] fp32 -> x rotated, [N, H, D] in x's dtype.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "logdiff rope: x [N, heads, head_dim] with "
              "contiguous, even head_dim expected, got ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "logdiff rope: fp32 cos and sin [N, head_dim] expected, got ", cos.sizes(), " ", cos.scalar_type());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "logdiff rope: x must be float32, bfloat16 or float16, got ", dtype);
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  switch (dtype) {
    case at::kFloat: run<float>(x, c, s, out); break;
    case at::kBFloat16: run<c10::BFloat16>(x, c, s, out); break;
    default: run<c10::Half>(x, c, s, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(logdiff, m) { m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope); }
