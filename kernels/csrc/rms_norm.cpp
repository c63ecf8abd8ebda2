// RMSNorm as Qwen3 computes it, with its one reduction in an order fixed by construction: the sum of squares of a
// row over 32 lanes, lane j taking the elements h = j mod 32 in ascending h (each square and each sum one fp32
// operation: -ffp-contract=off), the lanes then added in a fixed tree (lane j + 16 into j, then + 8, + 4, + 2, + 1).
// A row is reduced whole by one thread, and the lanes are 32 on every CPU (the compiler vectorises across lanes,
// never within one), so neither the rows beside it, nor the thread count, nor the vector width can change a bit.
// Then r = 1 / sqrt(sum / H + eps) (IEEE's correctly rounded divide and root), y = x r rounded to x's dtype, and
// out = w y in fp32 rounded once: torch's `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`. In torch ops the norm
// was eight calls (a decode step makes 17 norms); torch's sum also vectorises by the CPU's width, so its order
// followed the CPU.

#include "rounding.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <tuple>

namespace {

using logdiff::has_avx2;
using logdiff::has_avx512;
using logdiff::narrow;
using logdiff::widen;

constexpr int LANES = 32;

// Rows [begin, end) of x ([rows, H], rows xs elements apart) into out ([rows, H] contiguous); inv[i] = r of row i.
template <typename T>
__attribute__((always_inline)) inline void norm_rows(const T* x, int64_t xs, const T* w, int64_t H, float eps, T* out,
                                                     float* inv, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const T* row = x + i * xs;
    float lane[LANES] = {};
    int64_t h = 0;
    for (; h + LANES <= H; h += LANES)
      for (int j = 0; j < LANES; ++j) {
        const float v = widen(row[h + j]);
        lane[j] = lane[j] + v * v;
      }
    for (int j = 0; h + j < H; ++j) {
      const float v = widen(row[h + j]);
      lane[j] = lane[j] + v * v;
    }
    for (int width = LANES / 2; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) lane[j] = lane[j] + lane[j + width];
    const float r = 1.0f / std::sqrt(lane[0] / static_cast<float>(H) + eps);
    inv[i] = r;
    for (int64_t c = 0; c < H; ++c) {
      T y;
      narrow(widen(row[c]) * r, &y);
      narrow(widen(w[c]) * widen(y), out + i * H + c);
    }
  }
}

// The same loops compiled for AVX2 and AVX-512 (the compiler vectorises them; the bits are IEEE's either way).
template <typename T>
__attribute__((target("avx2,f16c"))) void norm_rows_avx2(const T* x, int64_t xs, const T* w, int64_t H, float eps,
                                                          T* out, float* inv, int64_t begin, int64_t end) {
  norm_rows(x, xs, w, H, eps, out, inv, begin, end);
}

template <typename T>
__attribute__((target("avx512f,avx512bw"))) void norm_rows_avx512(const T* x, int64_t xs, const T* w, int64_t H,
                                                                   float eps, T* out, float* inv, int64_t begin,
                                                                   int64_t end) {
  norm_rows(x, xs, w, H, eps, out, inv, begin, end);
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out, at::Tensor& inv) {
  const int64_t rows = x.size(0), H = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* ip = inv.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)), [&](int64_t begin, int64_t end) {
    if (has_avx512()) norm_rows_avx512(xp, xs, wp, H, e, op, ip, begin, end);
    else if (has_avx2()) norm_rows_avx2(xp, xs, wp, H, e, op, ip, begin, end);
    else norm_rows(xp, xs, wp, H, e, op, ip, begin, end);
  });
}

// x [rows, H] (rows contiguous), weight [H] of x's dtype -> (out [rows, H] in that dtype, r [rows] fp32).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(), "logdiff rms_norm: x must be a 2-d CPU tensor "
              "with contiguous rows, got ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "logdiff rms_norm: a weight [", x.size(1), "] of x's dtype ", x.scalar_type(), " expected, got ",
              weight.sizes(), " ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor inv = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(x, w, eps, out, inv); break;
    case at::kBFloat16: run<c10::BFloat16>(x, w, eps, out, inv); break;
    case at::kHalf: run<c10::Half>(x, w, eps, out, inv); break;
    default: TORCH_CHECK(false, "logdiff rms_norm: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return {out, inv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(logdiff, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)", &rms_norm);
}
