// logdiff's GEMM: C[b] = A[b] @ B[b] with ONE reduction order, by construction.
//
// Every output element is one fp32 accumulator that starts at +0 and takes the products over k in
// ascending order, one fused multiply-add each: c = fma(a[m][k], b[k][n], c), operands widened exactly
// from fp32/bf16/fp16. Nothing else touches it. Blocking (over M, N and K), packing, the ISA tier's
// vector width, the thread count and the operands' strides only decide WHICH elements are computed
// together and WHEN; a K block stores the accumulator in fp32 and the next block resumes it, so the
// sequence of roundings each element sees is the same whatever M, N, threads or layout are. K is never
// split across threads: a thread owns whole output elements. The three tiers (AVX-512, AVX2+FMA,
// portable std::fma) therefore give the same bits as each other.
//
// The result is fp32; the caller rounds it once to the output dtype.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Tier : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };

// Block sizes (a choice of speed, never of bits): a packed B block of KC x NC and an A block of MC x KC
// stay in L2 while the micro-kernel sweeps them.
constexpr int64_t KC = 256;
constexpr int64_t NC = 256;
constexpr int64_t MC = 96;

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

struct Strided {
  const void* data;
  int64_t batch, row, col;
};

// ------------------------------------------------------------------------------------------ packing

// A[m0:m0+mc, k0:k0+kc] -> fp32 panels of PANEL rows: panel p holds ap[p][k][r] (zero rows past mc).
template <typename TA, int PANEL>
void pack_a(const TA* a, int64_t rs, int64_t cs, int64_t mc, int64_t kc, float* out) {
  for (int64_t p = 0; p < mc; p += PANEL) {
    for (int64_t k = 0; k < kc; ++k) {
      for (int r = 0; r < PANEL; ++r) {
        out[k * PANEL + r] = p + r < mc ? widen(a[(p + r) * rs + k * cs]) : 0.0f;
      }
    }
    out += kc * PANEL;
  }
}

// B[k0:k0+kc, n0:n0+nc] -> row-major [kc][ldb] in B's own dtype, zero columns up to ldb.
template <typename TB>
void pack_b(const TB* b, int64_t rs, int64_t cs, int64_t kc, int64_t nc, int64_t ldb, TB* out) {
  if (cs == 1) {
    for (int64_t k = 0; k < kc; ++k) {
      std::memcpy(out + k * ldb, b + k * rs, nc * sizeof(TB));
      std::fill(out + k * ldb + nc, out + (k + 1) * ldb, TB(0.0f));
    }
    return;
  }
  for (int64_t k = 0; k < kc; ++k) std::fill(out + k * ldb + nc, out + (k + 1) * ldb, TB(0.0f));
  for (int64_t n = 0; n < nc; ++n) {  // a column of B is contiguous when it is a row of a [N, K] weight
    const TB* col = b + n * cs;
    for (int64_t k = 0; k < kc; ++k) out[k * ldb + n] = col[k * rs];
  }
}

// ------------------------------------------------------------------------------------ micro-kernels

constexpr int MR = 6;  // rows of a packed A panel; a micro-kernel computes ROWS <= MR of them

// c[r][j] (fp32, ldc) = fma over k of ap[k][r] * b[k][j]; `first` starts from +0 instead of c.

template <typename TB, int ROWS>
void micro_portable(int64_t kc, const float* ap, const TB* b, int64_t ldb, float* c, int64_t ldc, int64_t nr,
                    bool first) {
  for (int r = 0; r < ROWS; ++r) {
    for (int64_t j = 0; j < nr; ++j) {
      float acc = first ? 0.0f : c[r * ldc + j];
      for (int64_t k = 0; k < kc; ++k) acc = std::fma(ap[k * MR + r], widen(b[k * ldb + j]), acc);
      c[r * ldc + j] = acc;
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <typename TB, int ROWS>
__attribute__((target("avx2,fma,f16c"))) void micro_avx2(int64_t kc, const float* ap, const TB* b, int64_t ldb,
                                                         float* c, int64_t ldc, bool first) {
  constexpr int NV = 2;  // 16 columns
  __m256 acc[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + v * 8);
  for (int64_t k = 0; k < kc; ++k) {
    __m256 bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load8(b + k * ldb + v * 8);
    for (int r = 0; r < ROWS; ++r) {
      __m256 av = _mm256_broadcast_ss(ap + k * MR + r);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c + r * ldc + v * 8, acc[r][v]);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename TB, int ROWS>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void micro_avx512(int64_t kc, const float* ap, const TB* b,
                                                                       int64_t ldb, float* c, int64_t ldc,
                                                                       bool first) {
  constexpr int NV = 4;  // 64 columns
  __m512 acc[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + v * 16);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load16(b + k * ldb + v * 16);
    for (int r = 0; r < ROWS; ++r) {
      __m512 av = _mm512_set1_ps(ap[k * MR + r]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
}

int64_t panel_width(Tier tier) { return tier == AVX512 ? 64 : tier == AVX2 ? 16 : 1; }

// One micro-tile of `rows` (<= MR) rows and one panel of columns, the vector tiers on full-width panels.
template <typename TB>
void micro(Tier tier, int rows, int64_t kc, const float* ap, const TB* b, int64_t ldb, float* c, int64_t ldc,
           int64_t nr, bool first) {
#define LOGDIFF_ROWS(R)                                                      \
  case R:                                                                    \
    if (tier == AVX512) return micro_avx512<TB, R>(kc, ap, b, ldb, c, ldc, first); \
    if (tier == AVX2) return micro_avx2<TB, R>(kc, ap, b, ldb, c, ldc, first);     \
    return micro_portable<TB, R>(kc, ap, b, ldb, c, ldc, nr, first);
  switch (rows) {
    LOGDIFF_ROWS(1)
    LOGDIFF_ROWS(2)
    LOGDIFF_ROWS(3)
    LOGDIFF_ROWS(4)
    LOGDIFF_ROWS(5)
    LOGDIFF_ROWS(6)
  }
#undef LOGDIFF_ROWS
}

// ------------------------------------------------------------------------------------------- driver

// out[b] (fp32 [M, N], contiguous) = a[b] @ bm[b]. A task owns an (N block, M range) of one batch item,
// whole K: the partition decides nothing about any element's reduction.
template <typename TA, typename TB>
void gemm(Tier tier, Strided a, Strided bm, int64_t batch, int64_t M, int64_t N, int64_t K, float* out) {
  const int64_t width = panel_width(tier);
  const int64_t n_blocks = (N + NC - 1) / NC;
  const int64_t threads = at::get_num_threads();
  // M ranges: enough tasks for every thread when N alone does not give them, in whole MC blocks.
  const int64_t m_blocks_total = (M + MC - 1) / MC;
  const int64_t want = std::max<int64_t>(1, (2 * threads + batch * n_blocks - 1) / (batch * n_blocks));
  const int64_t m_blocks_per_task = (m_blocks_total + std::min(want, m_blocks_total) - 1) / std::min(want, m_blocks_total);
  const int64_t m_tasks = (m_blocks_total + m_blocks_per_task - 1) / m_blocks_per_task;
  const int64_t tasks = batch * n_blocks * m_tasks;

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // Per thread, kept between calls: a decode step makes hundreds of small GEMMs.
    thread_local std::vector<float> apack, tile;
    thread_local std::vector<TB> bpack;
    apack.resize(((MC + MR - 1) / MR) * MR * KC);
    bpack.resize(KC * ((NC + width - 1) / width) * width);
    tile.resize(MR * width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / (n_blocks * m_tasks);
      const int64_t nb = (task / m_tasks) % n_blocks;
      const int64_t mt = task % m_tasks;
      const TA* a_base = static_cast<const TA*>(a.data) + bi * a.batch;
      const TB* b_base = static_cast<const TB*>(bm.data) + bi * bm.batch;
      float* c_base = out + bi * M * N;
      const int64_t n0 = nb * NC, nc = std::min(NC, N - n0);
      const int64_t m_lo = mt * m_blocks_per_task * MC, m_hi = std::min(M, m_lo + m_blocks_per_task * MC);
      // B is read in place when its columns are contiguous and whole panels; otherwise packed.
      const bool in_place = bm.col == 1 && (tier == PORTABLE || nc % width == 0);
      const int64_t ldb_packed = (nc + width - 1) / width * width;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const TB* bk = b_base + k0 * bm.row + n0 * bm.col;
        const TB* bblock = bk;
        int64_t ldb = bm.row;
        if (!in_place) {
          pack_b<TB>(bk, bm.row, bm.col, kc, nc, ldb_packed, bpack.data());
          bblock = bpack.data();
          ldb = ldb_packed;
        }
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += MC) {
          const int64_t mc = std::min(MC, m_hi - m0);
          pack_a<TA, MR>(a_base + m0 * a.row + k0 * a.col, a.row, a.col, mc, kc, apack.data());
          for (int64_t p = 0; p < mc; p += MR) {
            const int rows = static_cast<int>(std::min<int64_t>(MR, mc - p));
            const float* ap = apack.data() + (p / MR) * kc * MR;
            float* c = c_base + (m0 + p) * N + n0;
            for (int64_t j = 0; j < nc; j += width) {
              const int64_t nr = std::min(width, nc - j);
              if (tier == PORTABLE) {
                micro<TB>(tier, rows, kc, ap, bblock + j, ldb, c + j, N, nr, k0 == 0);
              } else if (nr == width) {
                micro<TB>(tier, rows, kc, ap, bblock + j, ldb, c + j, N, nr, k0 == 0);
              } else {  // only a packed block has a partial panel; its zero columns are computed, not kept
                for (int r = 0; r < rows; ++r)
                  for (int64_t q = 0; q < nr; ++q) tile[r * width + q] = c[r * N + j + q];
                micro<TB>(tier, rows, kc, ap, bblock + j, ldb, tile.data(), width, nr, k0 == 0);
                for (int r = 0; r < rows; ++r)
                  for (int64_t q = 0; q < nr; ++q) c[r * N + j + q] = tile[r * width + q];
              }
            }
          }
        }
      }
    }
  });
}

template <typename TA>
void gemm_b(Tier tier, Strided a, Strided b, at::ScalarType tb, int64_t batch, int64_t M, int64_t N, int64_t K,
            float* out) {
  switch (tb) {
    case at::kFloat: return gemm<TA, float>(tier, a, b, batch, M, N, K, out);
    case at::kBFloat16: return gemm<TA, c10::BFloat16>(tier, a, b, batch, M, N, K, out);
    case at::kHalf: return gemm<TA, c10::Half>(tier, a, b, batch, M, N, K, out);
    default: TORCH_CHECK(false, "logdiff mm: B must be float32, bfloat16 or float16, got ", tb);
  }
}

bool cpu_has(Tier tier) {
  __builtin_cpu_init();
  if (tier == AVX512) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
  if (tier == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  return true;
}

// a [batch, M, K], b [batch, K, N], any strides -> fp32 [batch, M, N].
at::Tensor mm(const at::Tensor& a, const at::Tensor& b, int64_t tier) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, "logdiff mm: 3-d operands expected");
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(2) == b.size(1), "logdiff mm: shapes ", a.sizes(), " and ", b.sizes(),
              " do not multiply");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "logdiff mm: CPU tensors expected");
  TORCH_CHECK(tier >= PORTABLE && tier <= AVX512 && cpu_has(static_cast<Tier>(tier)),
              "logdiff mm: tier ", tier, " does not run on this CPU");
  const int64_t batch = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  at::Tensor out = at::empty({batch, M, N}, a.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  if (K == 0) return out.zero_();
  Strided sa{a.data_ptr(), a.stride(0), a.stride(1), a.stride(2)};
  Strided sb{b.data_ptr(), b.stride(0), b.stride(1), b.stride(2)};
  float* o = out.data_ptr<float>();
  const Tier t = static_cast<Tier>(tier);
  switch (a.scalar_type()) {
    case at::kFloat: gemm_b<float>(t, sa, sb, b.scalar_type(), batch, M, N, K, o); break;
    case at::kBFloat16: gemm_b<c10::BFloat16>(t, sa, sb, b.scalar_type(), batch, M, N, K, o); break;
    case at::kHalf: gemm_b<c10::Half>(t, sa, sb, b.scalar_type(), batch, M, N, K, o); break;
    default: TORCH_CHECK(false, "logdiff mm: A must be float32, bfloat16 or float16, got ", a.scalar_type());
  }
  return out;
}

bool tier_runs(int64_t tier) { return tier >= PORTABLE && tier <= AVX512 && cpu_has(static_cast<Tier>(tier)); }

}  // namespace

TORCH_LIBRARY(logdiff, m) {
  m.def("mm(Tensor a, Tensor b, int tier) -> Tensor", &mm);
  m.def("tier_runs(int tier) -> bool", &tier_runs);
}
