// The MoE combine: out[t] = w[t][0] e[t][0] + w[t][1] e[t][1] + ..., the slots added in routing order, every
// product and sum one fp32 operation (no fused multiply-add: -ffp-contract=off), rounded once to the experts'
// dtype. Elementwise along the hidden dimension, so no split or vector width can reorder it: the bits of
// `w[:, r, None] * e[:, r]` summed by k - 1 torch adds, in one pass over the expert outputs instead of 2k - 1.

#include "rounding.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <vector>

namespace {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, c10::BFloat16* out) { *out = logdiff::to_bf16(x); }
inline void narrow(float x, c10::Half* out) { *out = c10::Half(x); }

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

template <typename T>
void combine_typed(const at::Tensor& e, const at::Tensor& w, at::Tensor& out) {
  const int64_t T_ = e.size(0), k = e.size(1), H = e.size(2);
  const T* ep = e.data_ptr<T>();
  const float* wp = w.data_ptr<float>();
  T* op = out.data_ptr<T>();
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> acc;
    if (static_cast<int64_t>(acc.size()) < H) acc.resize(H);
    if (avx512) combine_tokens_avx512(ep, e.stride(0), e.stride(1), wp, k, H, op, begin, end, acc.data());
    else combine_tokens(ep, e.stride(0), e.stride(1), wp, k, H, op, begin, end, acc.data());
  });
}

// expert_out [T, k, H] (fp32, bf16 or fp16; H contiguous), weights [T, k] fp32 -> [T, H] in expert_out's dtype.
at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& weights) {
  TORCH_CHECK(expert_out.dim() == 3 && weights.dim() == 2 && weights.size(0) == expert_out.size(0) &&
                  weights.size(1) == expert_out.size(1) && expert_out.size(1) > 0,
              "logdiff combine: expert_out [T, k, H] and weights [T, k] expected, got ", expert_out.sizes(), " and ",
              weights.sizes());
  TORCH_CHECK(weights.scalar_type() == at::kFloat, "logdiff combine: fp32 weights expected, got ", weights.scalar_type());
  const at::Tensor e = expert_out.stride(2) == 1 ? expert_out : expert_out.contiguous();
  const at::Tensor w = weights.contiguous();
  at::Tensor out = at::empty({e.size(0), e.size(2)}, e.options());
  switch (e.scalar_type()) {
    case at::kFloat: combine_typed<float>(e, w, out); break;
    case at::kBFloat16: combine_typed<c10::BFloat16>(e, w, out); break;
    case at::kHalf: combine_typed<c10::Half>(e, w, out); break;
    default: TORCH_CHECK(false, "logdiff combine: expert outputs must be float32, bfloat16 or float16, got ", e.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(logdiff, m) { m.def("combine(Tensor expert_out, Tensor weights) -> Tensor", &combine); }
