// The MoE combine: out[t] = w[t][0] e[t][0] + w[t][1] e[t][1] + ..., the slots added in routing order, every
// product and sum one fp32 operation (no fused multiply-add: -ffp-contract=off), rounded once to the experts'
// dtype. Elementwise along the hidden dimension, so no split or vector width can reorder it: the bits of
// `w[:, r, None] * e[:, r]` summed by k - 1 torch adds, in one pass over the expert outputs instead of 2k - 1.
// Its backward is one pass too: d e[t][r] = g[t] w[t][r] rounded to e's dtype (torch's bits), d w[t][r] = the
// fp32 sum over H of g[t] e[t][r] in a fixed order (16 lanes, lane j taking h = j mod 16 in ascending order, the
// lanes added in order), whatever the threads.

#include "rounding.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>
#include <vector>

namespace {

using logdiff::has_avx512;
using logdiff::narrow;
using logdiff::widen;

// Tokens [begin, end): e [T, k, H] (slot stride es, token stride et, H contiguous), w [T, k] contiguous fp32.
template <typename T>
__attribute__((always_inline)) inline void combine_tokens(const T* e, int64_t et, int64_t es, const float* w, int64_t k,
                                                          int64_t H, T* out, int64_t begin, int64_t end, float* acc) {
  for (int64_t t = begin; t < end; ++t) {
    const T* token = e + t * et;
    const float* wt = w + t * k;
    for (int64_t h = 0; h < H; ++h) acc[h] = wt[0] * widen(token[h]);
    for (int64_t r = 1; r < k; ++r)
      for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + wt[r] * widen(token[r * es + h]);
    for (int64_t h = 0; h < H; ++h) narrow(acc[h], out + t * H + h);
  }
}

// The same loops compiled for AVX-512 (the compiler vectorises them 16 wide; the bits are IEEE's either way).
template <typename T>
__attribute__((target("avx512f,avx512bw"))) void combine_tokens_avx512(const T* e, int64_t et, int64_t es,
                                                                        const float* w, int64_t k, int64_t H, T* out,
                                                                        int64_t begin, int64_t end, float* acc) {
  combine_tokens(e, et, es, w, k, H, out, begin, end, acc);
}

// Tokens [begin, end) of the backward: g [T, H] contiguous, e as above, d_e [T, k, H] contiguous, d_w [T, k].
template <typename T>
__attribute__((always_inline)) inline void combine_backward_tokens(const T* g, const T* e, int64_t et, int64_t es,
                                                                   const float* w, int64_t k, int64_t H, T* d_e,
                                                                   float* d_w, int64_t begin, int64_t end) {
  constexpr int64_t LANES = 16;
  for (int64_t t = begin; t < end; ++t) {
    const T* gt = g + t * H;
    for (int64_t r = 0; r < k; ++r) {
      const T* er = e + t * et + r * es;
      const float wr = w[t * k + r];
      T* out = d_e + (t * k + r) * H;
      float lane[LANES] = {};
      int64_t h = 0;
      for (; h + LANES <= H; h += LANES)
        for (int64_t j = 0; j < LANES; ++j) {
          const float gh = widen(gt[h + j]);
          narrow(gh * wr, out + h + j);
          lane[j] = lane[j] + gh * widen(er[h + j]);
        }
      for (int64_t j = 0; h + j < H; ++j) {
        const float gh = widen(gt[h + j]);
        narrow(gh * wr, out + h + j);
        lane[j] = lane[j] + gh * widen(er[h + j]);
      }
      float sum = lane[0];
      for (int64_t j = 1; j < LANES; ++j) sum = sum + lane[j];
      d_w[t * k + r] = sum;
    }
  }
}

template <typename T>
__attribute__((target("avx512f,avx512bw"))) void combine_backward_tokens_avx512(
    const T* g, const T* e, int64_t et, int64_t es, const float* w, int64_t k, int64_t H, T* d_e, float* d_w,
    int64_t begin, int64_t end) {
  combine_backward_tokens(g, e, et, es, w, k, H, d_e, d_w, begin, end);
}

template <typename T>
void combine_backward_typed(const at::Tensor& g, const at::Tensor& e, const at::Tensor& w, at::Tensor& d_e,
                            at::Tensor& d_w) {
  const int64_t T_ = e.size(0), k = e.size(1), H = e.size(2);
  const T *gp = g.data_ptr<T>(), *ep = e.data_ptr<T>();
  const float* wp = w.data_ptr<float>();
  T* dep = d_e.data_ptr<T>();
  float* dwp = d_w.data_ptr<float>();
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    if (has_avx512()) combine_backward_tokens_avx512(gp, ep, e.stride(0), e.stride(1), wp, k, H, dep, dwp, begin, end);
    else combine_backward_tokens(gp, ep, e.stride(0), e.stride(1), wp, k, H, dep, dwp, begin, end);
  });
}

template <typename T>
void combine_typed(const at::Tensor& e, const at::Tensor& w, at::Tensor& out) {
  const int64_t T_ = e.size(0), k = e.size(1), H = e.size(2);
  const T* ep = e.data_ptr<T>();
  const float* wp = w.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> acc;
    if (static_cast<int64_t>(acc.size()) < H) acc.resize(H);
    if (has_avx512()) combine_tokens_avx512(ep, e.stride(0), e.stride(1), wp, k, H, op, begin, end, acc.data());
    else combine_tokens(ep, e.stride(0), e.stride(1), wp, k, H, op, begin, end, acc.data());
  });
}

void check_operands(const at::Tensor& expert_out, const at::Tensor& weights) {
  TORCH_CHECK(expert_out.dim() == 3 && weights.dim() == 2 && weights.size(0) == expert_out.size(0) &&
                  weights.size(1) == expert_out.size(1) && expert_out.size(1) > 0,
              "logdiff combine: expert_out [T, k, H] and weights [T, k] expected, got ", expert_out.sizes(), " and ",
              weights.sizes());
  TORCH_CHECK(weights.scalar_type() == at::kFloat, "logdiff combine: fp32 weights expected, got ", weights.scalar_type());
  const auto dtype = expert_out.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "logdiff combine: expert outputs must be float32, bfloat16 or float16, got ", dtype);
}

// expert_out [T, k, H] (fp32, bf16 or fp16; H contiguous), weights [T, k] fp32 -> [T, H] in expert_out's dtype.
at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& weights) {
  check_operands(expert_out, weights);
  const at::Tensor e = expert_out.stride(2) == 1 ? expert_out : expert_out.contiguous();
  const at::Tensor w = weights.contiguous();
  at::Tensor out = at::empty({e.size(0), e.size(2)}, e.options());
  switch (e.scalar_type()) {
    case at::kFloat: combine_typed<float>(e, w, out); break;
    case at::kBFloat16: combine_typed<c10::BFloat16>(e, w, out); break;
    default: combine_typed<c10::Half>(e, w, out);
  }
  return out;
}

// grad [T, H] of combine's output -> (d expert_out [T, k, H] in its dtype, d weights [T, k] fp32).
std::tuple<at::Tensor, at::Tensor> combine_backward(const at::Tensor& grad, const at::Tensor& expert_out,
                                                    const at::Tensor& weights) {
  check_operands(expert_out, weights);
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == expert_out.size(0) && grad.size(1) == expert_out.size(2) &&
                  grad.scalar_type() == expert_out.scalar_type(),
              "logdiff combine: a gradient [T, H] in the outputs' dtype expected, got ", grad.sizes(), " ", grad.scalar_type());
  const at::Tensor g = grad.contiguous();
  const at::Tensor e = expert_out.stride(2) == 1 ? expert_out : expert_out.contiguous();
  const at::Tensor w = weights.contiguous();
  at::Tensor d_e = at::empty(e.sizes(), e.options());
  at::Tensor d_w = at::empty(w.sizes(), w.options());
  switch (e.scalar_type()) {
    case at::kFloat: combine_backward_typed<float>(g, e, w, d_e, d_w); break;
    case at::kBFloat16: combine_backward_typed<c10::BFloat16>(g, e, w, d_e, d_w); break;
    default: combine_backward_typed<c10::Half>(g, e, w, d_e, d_w);
  }
  return {d_e, d_w};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(logdiff, m) {
  m.def("combine(Tensor expert_out, Tensor weights) -> Tensor", &combine);
  m.def("combine_backward(Tensor grad, Tensor expert_out, Tensor weights) -> (Tensor, Tensor)", &combine_backward);
}
