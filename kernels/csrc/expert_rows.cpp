// Where the reference's expert buffer puts each (token, slot) pair of a routing: expert after expert, each expert's
// pairs in (token, slot) order (a stable counting sort by expert). In torch ops the same layout took about thirty
// small calls per MoE layer (argsort, cumsums, index arithmetic, two scatters): a decode step's share of its
// ~2000 ops. Only which row holds a pair is decided here; no arithmetic on the data, so no bits.

#include <torch/library.h>
#include <torch/types.h>

#include <tuple>
#include <vector>

namespace {

// ids [N, k] int64 in [0, E) -> (source [R]: the token each buffer row reads, N for a padding row; row_of_pair
// [N * k]: the buffer row of pair (t, r) at t * k + r; offsets [E + 1]: expert e's rows start at offsets[e]).
// With `capacity` > 0 every expert gets `capacity` rows (one batched GEMM over all experts), else its pairs'.
std::tuple<at::Tensor, at::Tensor, at::Tensor> expert_rows(const at::Tensor& ids, int64_t num_experts, int64_t capacity) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.device().is_cpu(),
              "logdiff expert_rows: ids [N, k] int64 on the CPU expected, got ", ids.sizes(), " ", ids.scalar_type());
  TORCH_CHECK(num_experts > 0 && capacity >= 0, "logdiff expert_rows: num_experts > 0 and capacity >= 0 expected");
  const at::Tensor flat = ids.contiguous();
  const int64_t* id = flat.data_ptr<int64_t>();
  const int64_t pairs = flat.numel(), top_k = ids.size(1);
  std::vector<int64_t> count(num_experts, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "logdiff expert_rows: expert id ", id[p], " outside [0, ",
                num_experts, ")");
    ++count[id[p]];
  }
  at::Tensor offsets = at::empty({num_experts + 1}, flat.options());
  int64_t* off = offsets.data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    TORCH_CHECK(capacity == 0 || count[e] <= capacity, "logdiff expert_rows: expert ", e, " has ", count[e],
                " pairs, more than the capacity ", capacity);
    off[e + 1] = off[e] + (capacity ? capacity : count[e]);
  }
  at::Tensor source = at::full({off[num_experts]}, ids.size(0), flat.options());
  at::Tensor row_of_pair = at::empty({pairs}, flat.options());
  int64_t* src = source.data_ptr<int64_t>();
  int64_t* row = row_of_pair.data_ptr<int64_t>();
  std::vector<int64_t> next(off, off + num_experts);
  for (int64_t p = 0; p < pairs; ++p) {
    row[p] = next[id[p]]++;
    src[row[p]] = p / top_k;
  }
  return {source, row_of_pair, offsets};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(logdiff, m) {
  m.def("expert_rows(Tensor ids, int num_experts, int capacity) -> (Tensor, Tensor, Tensor)", &expert_rows);
}
