// logdiff's GEMM: C[b] = A[b] @ B[b] with ONE reduction order, by construction.
//
// Every output element is one fp32 accumulator that starts at +0 and takes the products over k in
// ascending order, one fused multiply-add each: c = fma(a[m][k], b[k][n], c), operands widened exactly
// from fp32/bf16/fp16. Nothing else touches it. Blocking (over M, N and K), packing, the ISA tier's
// vector width, the thread count and the operands' strides only decide WHICH elements are computed
// together and WHEN; a K block stores the accumulator in fp32 and the next block resumes it, so the
// sequence of roundings each element sees is the same whatever M, N, threads or layout are. K is never
// split across threads: a thread owns whole output elements. The three FMA tiers (AVX-512, AVX2+FMA,
// portable std::fma) therefore give the same bits as each other.
//
// Two tiers take bf16 x bf16 only, reading both as stored (2 bytes) into fp32 accumulators: AVX512-BF16
// (vdpbf16ps) and AMX-BF16 (tdpbf16ps). Their step is the hardware's dot product of a PAIR of k (k even
// and k+1), pairs in ascending order; AMX's tiles take 16 pairs per instruction, in ascending order, and
// a K block resumes the fp32 accumulator as above. The step differs from one FMA per k (and between
// the two), so their bits differ from the FMA tiers', but within a tier each element still sees one
// sequence fixed by K alone: rows, columns and K padding are zeros the hardware multiplies and the
// element never sees from its neighbours.
//
// The result is fp32, or rounded once (to nearest even) to bf16 or fp16 by the task that computed it, while
// its block is still in cache.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "rounding.h"

#include <cpuid.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using logdiff::round_bf16;
using logdiff::round_bf16_avx2;
using logdiff::to_bf16;
using logdiff::widen;

enum Tier : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3, AMX_BF16 = 4 };

// Block sizes (a choice of speed, never of bits). A task's N block is at most NC columns wide. The pair tiers
// keep a packed B block of KC x NC in L2. The FMA tiers sweep a thread's consecutive N blocks as one, an A block
// of MC x KC_FMA in L2 (fp32) against a packed B block of KC_FMA x SWEEP (in L3, 2 MB of bf16), one panel of
// which stays in L1 while the A block's panels pass: bf16 M 1024 K 1024 N 3072 on a Zen 3, one core, 72-81 GFLOP/s
// with a KC x NC block swept row panel by row panel, 89-93 like this (MKL's fp32 sgemm: 89-95).
constexpr int64_t KC = 256;
constexpr int64_t NC = 256;
constexpr int64_t KC_FMA = 512;
constexpr int64_t MC = 96;
constexpr int64_t SWEEP = 2048;

struct Strided {
  const void* data;
  int64_t batch, row, col;
};

// Where a GEMM's result goes: fp32 accumulators `acc` ([batch, M, N], contiguous); with `total` (the same
// layout), each task adds its block into it once the block is complete (a K chunk's GEMM joining the sum of the
// chunks before it); with `rounded`, the task then rounds its block of the sum (or of acc) to bf16 or fp16.
// With `transposed`, the GEMM computed C^T: each task writes its block of it, transposed, into `rounded` (the
// result C, in its dtype, fp32 included).
struct Output;
void store_transposed(const Output& o, const float* block, int64_t ld, int64_t bi, int64_t M, int64_t N, int64_t m_lo,
                      int64_t m_hi, int64_t n0, int64_t nc);

struct Output {
  float* acc;
  float* total = nullptr;
  void* rounded = nullptr;
  at::ScalarType dtype = at::kFloat;
  Tier tier = PORTABLE;  // the widest rounding it may use
  bool transposed = false;

  void finish(int64_t bi, int64_t M, int64_t N, int64_t m_lo, int64_t m_hi, int64_t n0, int64_t nc) const {
    if (transposed) return store_transposed(*this, acc + bi * M * N + m_lo * N + n0, N, bi, M, N, m_lo, m_hi, n0, nc);
    if (total == nullptr && rounded == nullptr) return;
    for (int64_t r = m_lo; r < m_hi; ++r) {
      const int64_t at = bi * M * N + r * N + n0;
      const float* sum = acc + at;
      if (total != nullptr) {
        float* t = total + at;
        for (int64_t q = 0; q < nc; ++q) t[q] = t[q] + sum[q];
        sum = t;
      }
      if (rounded != nullptr) write(sum, at, nc);
    }
  }

  // n fp32 values into `rounded` from element `at` on, in its dtype: copied, or rounded once.
  void write(const float* src, int64_t at, int64_t n) const {
    if (dtype == at::kFloat) {
      std::copy(src, src + n, static_cast<float*>(rounded) + at);
    } else if (dtype == at::kBFloat16) {
      auto* dst = static_cast<c10::BFloat16*>(rounded) + at;
      if (tier >= AVX512) round_bf16(src, dst, n);
      else if (tier >= AVX2) round_bf16_avx2(src, dst, n);
      else
        for (int64_t q = 0; q < n; ++q) dst[q] = to_bf16(src[q]);
    } else {
      auto* dst = static_cast<c10::Half*>(rounded) + at;
      for (int64_t q = 0; q < n; ++q) dst[q] = c10::Half(src[q]);
    }
  }
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

// 16 x 16 32-bit words, rows in r[0..15] -> the transpose, in place (unpack 32, unpack 64, two 128-bit shuffles).
__attribute__((target("avx512f"))) inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// out[j][i] (row stride ldo) = in[i][j] (row stride ldi) for a 16 x 16 tile; 2-byte words move as 32-bit lanes.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void transpose_tile16(const T* in, int64_t ldi, T* out, int64_t ldo) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) {
    if constexpr (sizeof(T) == 4) r[i] = _mm512_loadu_si512(in + i * ldi);
    else r[i] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i * ldi)));
  }
  transpose16(r);
  for (int j = 0; j < 16; ++j) {
    if constexpr (sizeof(T) == 4) _mm512_storeu_si512(out + j * ldo, r[j]);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * ldo), _mm512_cvtepi32_epi16(r[j]));
  }
}

bool cpu_has(Tier tier);

// B's rows (contiguous columns) -> panels, eight rows at a time: a panel's part of them is one contiguous store of
// 8 x WIDTH, where a row at a time would write every panel at the same cache set (the panels are kc x WIDTH apart).
template <typename TB, int WIDTH>
void pack_rows_in_panels(const TB* b, int64_t rs, int64_t kc, int64_t nc, TB* out) {
  constexpr int64_t ROWS = 8;
  const int64_t whole = nc / WIDTH * WIDTH;
  for (int64_t k0 = 0; k0 < kc; k0 += ROWS) {
    const int64_t rows = std::min(ROWS, kc - k0);
    // a constant size, so that the compiler moves it in registers rather than calling memcpy
    for (int64_t n = 0; n < whole; n += WIDTH)
      for (int64_t k = k0; k < k0 + rows; ++k)
        std::memcpy(out + n * kc + k * WIDTH, b + k * rs + n, WIDTH * sizeof(TB));
    if (whole < nc)
      for (int64_t k = k0; k < k0 + rows; ++k)
        std::memcpy(out + whole * kc + k * WIDTH, b + k * rs + whole, (nc - whole) * sizeof(TB));
  }
}

// B[k0:k0+kc, n0:n0+nc] -> panels of `width` columns in B's own dtype, panel p at out + p * kc * width, each
// [kc][width] (zero columns past nc): the micro-kernel walks a panel down k in one contiguous stream.
template <typename TB>
void pack_b(const TB* b, int64_t rs, int64_t cs, int64_t kc, int64_t nc, int64_t width, TB* out) {
  const int64_t whole = nc / width * width;
  TB* last_panel = out + whole * kc;
  if (whole < nc)
    for (int64_t k = 0; k < kc; ++k) std::fill(last_panel + k * width + (nc - whole), last_panel + (k + 1) * width, TB(0.0f));
  if (cs == 1) {  // packed only for a vector tier (the portable one reads such a B in place)
    if (width == 16) return pack_rows_in_panels<TB, 16>(b, rs, kc, nc, out);
    return pack_rows_in_panels<TB, 64>(b, rs, kc, nc, out);
  }
  // A column of B is contiguous when it is a row of a [N, K] weight (rs == 1): 16 x 16 tiles are transposed in
  // registers, each row of the weight read along k. Only data moves: the layout never reaches a reduction.
  static const bool avx512 = cpu_has(AVX512);
  const bool tiles = rs == 1 && avx512 && width % 16 == 0;
  const int64_t n_tiled = tiles ? nc / 16 * 16 : 0, k_tiled = tiles ? kc / 16 * 16 : 0;
  for (int64_t n = 0; n < n_tiled; n += 16)
    for (int64_t k = 0; k < k_tiled; k += 16)
      transpose_tile16<TB>(b + n * cs + k, cs, out + n / width * width * kc + k * width + n % width, width);
  for (int64_t n = 0; n < nc; ++n) {
    const TB* col = b + n * cs;
    TB* dst = out + n / width * width * kc + n % width;
    for (int64_t k = n < n_tiled ? k_tiled : 0; k < kc; ++k) dst[k * width] = col[k * rs];
  }
}

// ------------------------------------------------------------------------------------ micro-kernels

// Loops over a micro-tile's registers unrolled before GCC decides where arrays of vectors live: without it
// GCC kept micro_avx2's 12 accumulators in registers AND stored all 12 to the stack at every k (28 of 80 GFLOP/s
// on a Zen 3 core).
#define UNROLLED _Pragma("GCC unroll 16")

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
  UNROLLED for (int r = 0; r < ROWS; ++r)
    UNROLLED for (int v = 0; v < NV; ++v) acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + v * 8);
  for (int64_t k = 0; k < kc; ++k) {
    __m256 bv[NV];
    UNROLLED for (int v = 0; v < NV; ++v) bv[v] = load8(b + k * ldb + v * 8);
    UNROLLED for (int r = 0; r < ROWS; ++r) {
      __m256 av = _mm256_broadcast_ss(ap + k * MR + r);
      UNROLLED for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  UNROLLED for (int r = 0; r < ROWS; ++r)
    UNROLLED for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c + r * ldc + v * 8, acc[r][v]);
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
  UNROLLED for (int r = 0; r < ROWS; ++r)
    UNROLLED for (int v = 0; v < NV; ++v) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + v * 16);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 bv[NV];
    UNROLLED for (int v = 0; v < NV; ++v) bv[v] = load16(b + k * ldb + v * 16);
    UNROLLED for (int r = 0; r < ROWS; ++r) {
      __m512 av = _mm512_set1_ps(ap[k * MR + r]);
      UNROLLED for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  UNROLLED for (int r = 0; r < ROWS; ++r)
    UNROLLED for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
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

// ------------------------------------------------------------------ few rows streaming B's rows in place

// For a few rows against a B whose rows of n are contiguous (a K-major weight: a decode step), the FMA tiers
// stream B row by row: for k ascending, row k of the task's columns is read once, contiguously, into the
// rows' fp32 accumulators (in acc, in L1). The micro-kernel instead walks a 16- or 64-column panel down all of
// K, a new page at every k (the row stride is N): M 1, K 512, N 16384 bf16 ran at 7.2 GB/s on one AVX2 core.
// Every element still takes c = fma(a[m][k], b[k][n], c) for k ascending from +0, in a vector lane or (the
// columns past the last whole vector) in std::fma, which rounds the same: the same bits.
constexpr int64_t STREAM_ROWS = 6;
constexpr int64_t STREAM_ACC = 4096;  // accumulators per task (16 KB, in L1): M x its columns
constexpr int64_t STREAM_AHEAD = 4;  // rows of B prefetched ahead: the next row starts on another page

// Rows k..k+KU-1 of B (KU <= 4) into the accumulators: each vector of columns is loaded once, takes its KU
// products in ascending k and is stored (a quarter of the accumulator traffic of one row at a time).
#define LOGDIFF_STREAM_ROWS_OF_B(VEC, W, SET1, LOAD, FMA, LOADU, STOREU)                          \
  UNROLLED for (int r = 0; r < ROWS; ++r)                                                         \
    UNROLLED for (int u = 0; u < KU; ++u) av[r][u] = SET1(widen(a[r * ars + (k + u) * acs]));     \
  for (int64_t j = 0; j < whole; j += W) {                                                        \
    if (j * int64_t(sizeof(TB)) % 64 == 0)                                                        \
      UNROLLED for (int u = 0; u < KU; ++u) _mm_prefetch(ahead[u] + j * sizeof(TB), _MM_HINT_T0); \
    VEC bv[KU];                                                                                   \
    UNROLLED for (int u = 0; u < KU; ++u) bv[u] = LOAD(b + (k + u) * ldb + j);                    \
    UNROLLED for (int r = 0; r < ROWS; ++r) {                                                     \
      float* cr = c + r * ldc + j;                                                                \
      VEC acc = LOADU(cr);                                                                        \
      UNROLLED for (int u = 0; u < KU; ++u) acc = FMA(av[r][u], bv[u], acc);                      \
      STOREU(cr, acc);                                                                            \
    }                                                                                             \
  }                                                                                               \
  UNROLLED for (int r = 0; r < ROWS; ++r)                                                         \
    UNROLLED for (int u = 0; u < KU; ++u) {                                                       \
      const float ak = widen(a[r * ars + (k + u) * acs]);                                         \
      for (int64_t q = whole; q < nc; ++q)                                                        \
        c[r * ldc + q] = std::fma(ak, widen(b[(k + u) * ldb + q]), c[r * ldc + q]);               \
    }

// Rows of B prefetched STREAM_AHEAD rows ahead of k..k+KU-1 (each row starts on a page of its own).
template <typename TB>
void rows_ahead(const TB* b, int64_t ldb, int64_t k, int64_t K, int ku, const char** ahead) {
  for (int u = 0; u < ku; ++u)
    ahead[u] = reinterpret_cast<const char*>(b + std::min(k + u + STREAM_AHEAD, K - 1) * ldb);
}

template <typename TA, typename TB, int ROWS, int KU>
__attribute__((target("avx2,fma,f16c"))) void stream_rows_avx2(const TA* a, int64_t ars, int64_t acs, int64_t k,
                                                               int64_t K, const TB* b, int64_t ldb, float* c,
                                                               int64_t ldc, int64_t nc) {
  const int64_t whole = nc / 8 * 8;
  const char* ahead[KU];
  rows_ahead(b, ldb, k, K, KU, ahead);
  __m256 av[ROWS][KU];
  LOGDIFF_STREAM_ROWS_OF_B(__m256, 8, _mm256_set1_ps, load8, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_storeu_ps)
}

template <typename TA, typename TB, int ROWS, int KU>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void stream_rows_avx512(const TA* a, int64_t ars, int64_t acs,
                                                                             int64_t k, int64_t K, const TB* b,
                                                                             int64_t ldb, float* c, int64_t ldc,
                                                                             int64_t nc) {
  const int64_t whole = nc / 16 * 16;
  const char* ahead[KU];
  rows_ahead(b, ldb, k, K, KU, ahead);
  __m512 av[ROWS][KU];
  LOGDIFF_STREAM_ROWS_OF_B(__m512, 16, _mm512_set1_ps, load16, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_storeu_ps)
}
#undef LOGDIFF_STREAM_ROWS_OF_B

// c[r][0:nc] (ldc) = fma over k ascending of a[r][k] * b[k][0:nc], from +0, for ROWS rows: 4 rows of B at a time.
template <typename TA, typename TB, int ROWS>
void stream(Tier tier, const TA* a, int64_t ars, int64_t acs, int64_t K, const TB* b, int64_t ldb, float* c,
            int64_t ldc, int64_t nc) {
  for (int r = 0; r < ROWS; ++r) std::fill(c + r * ldc, c + r * ldc + nc, 0.0f);
  int64_t k = 0;
  if (tier == AVX512) {
    for (; k + 4 <= K; k += 4) stream_rows_avx512<TA, TB, ROWS, 4>(a, ars, acs, k, K, b, ldb, c, ldc, nc);
    for (; k < K; ++k) stream_rows_avx512<TA, TB, ROWS, 1>(a, ars, acs, k, K, b, ldb, c, ldc, nc);
  } else {
    for (; k + 4 <= K; k += 4) stream_rows_avx2<TA, TB, ROWS, 4>(a, ars, acs, k, K, b, ldb, c, ldc, nc);
    for (; k < K; ++k) stream_rows_avx2<TA, TB, ROWS, 1>(a, ars, acs, k, K, b, ldb, c, ldc, nc);
  }
}

// out[b] (fp32 [M, N], contiguous) = a[b] @ bm[b] for M <= STREAM_ROWS and bm.col == 1 on AVX2 or AVX-512. Tasks
// are (batch item, column block): as many blocks as threads when the batch alone does not fill them.
template <typename TA, typename TB>
void gemm_stream(Tier tier, Strided a, Strided bm, int64_t batch, int64_t M, int64_t N, int64_t K, const Output& out) {
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t columns = std::max<int64_t>(64, STREAM_ACC / M / 64 * 64);
  const int64_t want = std::max((N + columns - 1) / columns, (threads + batch - 1) / batch);
  const int64_t n_step = std::max<int64_t>(64, (N + want - 1) / want + 63) / 64 * 64;
  const int64_t n_blocks = (N + n_step - 1) / n_step;
  at::parallel_for(0, batch * n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / n_blocks, n0 = task % n_blocks * n_step, nc = std::min(n_step, N - n0);
      const TA* ab = static_cast<const TA*>(a.data) + bi * a.batch;
      const TB* bb = static_cast<const TB*>(bm.data) + bi * bm.batch + n0;
      float* c = out.acc + bi * M * N + n0;
#define LOGDIFF_STREAM(R) \
  case R: stream<TA, TB, R>(tier, ab, a.row, a.col, K, bb, bm.row, c, N, nc); break;
      switch (M) {
        LOGDIFF_STREAM(1)
        LOGDIFF_STREAM(2)
        LOGDIFF_STREAM(3)
        LOGDIFF_STREAM(4)
        LOGDIFF_STREAM(5)
        LOGDIFF_STREAM(6)
      }
#undef LOGDIFF_STREAM
      out.finish(bi, M, N, 0, M, n0, nc);
    }
  });
}

// ------------------------------------------------------------------------------------------- driver

// Tasks: a task owns an (N block, M range) of one batch item, whole K, so the partition decides nothing
// about any element's reduction. N blocks (at most NC, whole 64-column panels) and M ranges (whole units of
// `m_unit` rows) are cut even, so that the threads' shares are: a 384 x 128 expert GEMM cut 256 + 128 and
// 96 + 32 gave one of two threads twice the other's work. M ranges give every thread work when N alone does not.
struct Plan {
  int64_t n_step, n_blocks, m_step, m_tasks, tasks;

  // max_rows (if not 0): M ranges of at most about this many rows, for a task that keeps its block of C in a
  // buffer of its own.
  Plan(int64_t batch, int64_t M, int64_t N, int64_t m_unit, int64_t max_rows = 0) {
    const int64_t even_blocks = (N + NC - 1) / NC;
    n_step = ((N + even_blocks - 1) / even_blocks + 63) / 64 * 64;
    n_blocks = (N + n_step - 1) / n_step;
    const int64_t units = (M + m_unit - 1) / m_unit;
    // Inside a parallel region (a thread's whole groups) the tasks run on this thread alone: M is not cut,
    // which would pack each B block once per M range.
    const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    const int64_t want = std::max<int64_t>(1, (2 * threads + batch * n_blocks - 1) / (batch * n_blocks));
    const int64_t ranges = std::min(units, std::max(want, max_rows ? (M + max_rows - 1) / max_rows : 1));
    m_step = (units + ranges - 1) / ranges * m_unit;
    m_tasks = (M + m_step - 1) / m_step;
    tasks = batch * n_blocks * m_tasks;
  }
  int64_t batch_item(int64_t task) const { return task / (n_blocks * m_tasks); }
  int64_t n0(int64_t task) const { return (task / m_tasks) % n_blocks * n_step; }
  int64_t nc(int64_t task, int64_t N) const { return std::min(n_step, N - n0(task)); }
  int64_t m_lo(int64_t task) const { return (task % m_tasks) * m_step; }
  int64_t m_hi(int64_t task, int64_t M) const { return std::min(M, m_lo(task) + m_step); }
};

// out[b] (fp32 [M, N], contiguous) = a[b] @ bm[b] on an FMA tier.
template <typename TA, typename TB>
void gemm(Tier tier, Strided a, Strided bm, int64_t batch, int64_t M, int64_t N, int64_t K, const Output& out) {
  if (tier != PORTABLE && bm.col == 1 && M <= STREAM_ROWS) return gemm_stream<TA, TB>(tier, a, bm, batch, M, N, K, out);
  const int64_t width = panel_width(tier);
  const Plan plan(batch, M, N, MR);

  at::parallel_for(0, plan.tasks, 1, [&](int64_t begin, int64_t end) {
    // Per thread, kept between calls: a decode step makes hundreds of small GEMMs.
    thread_local std::vector<float> apack, tile;
    thread_local std::vector<TB> bpack;
    apack.resize(((MC + MR - 1) / MR) * MR * KC_FMA);
    bpack.resize(KC_FMA * SWEEP);
    tile.resize(MR * width);
    for (int64_t task = begin; task < end;) {
      const int64_t bi = plan.batch_item(task);
      const int64_t m_lo = plan.m_lo(task), m_hi = plan.m_hi(task, M), n0 = plan.n0(task);
      // This thread's next tasks over the same rows are the next N blocks: swept as one, up to SWEEP columns, so
      // that an A block is packed once per sweep rather than once per N block.
      int64_t last = task;
      while (plan.m_tasks == 1 && last + 1 < end && plan.batch_item(last + 1) == bi &&
             plan.n0(last + 1) + plan.nc(last + 1, N) - n0 <= SWEEP)
        ++last;
      const int64_t nc = plan.n0(last) + plan.nc(last, N) - n0;
      const TA* a_base = static_cast<const TA*>(a.data) + bi * a.batch;
      const TB* b_base = static_cast<const TB*>(bm.data) + bi * bm.batch;
      float* c_base = out.acc + bi * M * N;
      // B is read in place when its columns are contiguous and whole panels and its rows at most 1 KB apart;
      // otherwise packed. A panel walking down rows further apart reaches a new page every few k (every k at
      // N 16384): bf16 on a Zen 3, measured with the row-panel blocking before the sweep, M 64 K 512 N 16384 one
      // core 48 GFLOP/s in place vs 66 packed, M 1024 K 1024 N 2048 two cores 101 vs 139; N 384 (768 B apart),
      // one core 81 vs 72.
      const bool in_place = bm.col == 1 && (tier == PORTABLE || (nc % width == 0 && bm.row * int64_t(sizeof(TB)) <= 1024));
      for (int64_t k0 = 0; k0 < K; k0 += KC_FMA) {
        const int64_t kc = std::min(KC_FMA, K - k0);
        const TB* bk = b_base + k0 * bm.row + n0 * bm.col;
        if (!in_place) pack_b<TB>(bk, bm.row, bm.col, kc, nc, width, bpack.data());
        const int64_t ldb = in_place ? bm.row : width;
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += MC) {
          const int64_t mc = std::min(MC, m_hi - m0);
          pack_a<TA, MR>(a_base + m0 * a.row + k0 * a.col, a.row, a.col, mc, kc, apack.data());
          // A panel of B stays in L1 while the block's A panels come from L2.
          for (int64_t j = 0; j < nc; j += width) {
            const int64_t nr = std::min(width, nc - j);
            const TB* bp = in_place ? bk + j : bpack.data() + j * kc;
            for (int64_t p = 0; p < mc; p += MR) {
              const int rows = static_cast<int>(std::min<int64_t>(MR, mc - p));
              const float* ap = apack.data() + (p / MR) * kc * MR;
              float* c = c_base + (m0 + p) * N + n0 + j;
              if (tier == PORTABLE || nr == width) {
                micro<TB>(tier, rows, kc, ap, bp, ldb, c, N, nr, k0 == 0);
              } else {  // only a packed block has a partial panel; its zero columns are computed, not kept
                for (int r = 0; r < rows; ++r)
                  for (int64_t q = 0; q < nr; ++q) tile[r * width + q] = c[r * N + q];
                micro<TB>(tier, rows, kc, ap, bp, width, tile.data(), width, nr, k0 == 0);
                for (int r = 0; r < rows; ++r)
                  for (int64_t q = 0; q < nr; ++q) c[r * N + q] = tile[r * width + q];
              }
            }
          }
        }
      }
      out.finish(bi, M, N, m_lo, m_hi, n0, nc);
      task = last + 1;
    }
  });
}

// ------------------------------------------------------------------- bf16 pair tiers (AVX512-BF16, AMX)

using bf16 = c10::BFloat16;

// Two bf16 of consecutive k as one 32-bit word, the even k in the low half: what vdpbf16ps and tdpbf16ps read.
inline uint32_t pair(bf16 even, bf16 odd) { return uint32_t(even.x) | (uint32_t(odd.x) << 16); }

// Word (m, p) of a [count x K] bf16 operand (row stride rs, k stride cs): (a[m][2p], a[m][2p+1]), zero past
// count and K.
inline uint32_t pair_word(const bf16* a, int64_t rs, int64_t cs, int64_t count, int64_t K, int64_t m, int64_t p) {
  const bf16 zero(0.0f);
  const int64_t k = 2 * p;
  return m < count ? pair(k < K ? a[m * rs + k * cs] : zero, k + 1 < K ? a[m * rs + (k + 1) * cs] : zero) : 0u;
}

// A[m0:m0+mc, k0:k0+kc] -> words [rows][pairs] (row-major, `rows` >= mc rows, zeros past mc and kc). The
// loop runs along A's contiguous dimension: a row of k, or (a weight stored K-major) a row of m.
void pack_a_pairs(const bf16* a, int64_t rs, int64_t cs, int64_t mc, int64_t kc, int64_t rows, int64_t pairs,
                  uint32_t* out) {
  auto word = [&](int64_t m, int64_t p) { return pair_word(a, rs, cs, mc, kc, m, p); };
  if (rs < cs) {
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t m = 0; m < rows; ++m) out[m * pairs + p] = word(m, p);
  } else {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t p = 0; p < pairs; ++p) out[m * pairs + p] = word(m, p);
  }
}

// dst[m][k] (rows ld apart) = a[m][k] (row stride rs, k stride cs), m < rows, k < K. A transposed activation
// (m contiguous, as a weight gradient reads it) moves as 16 x 16 tiles transposed in registers: element by
// element it cost a 384 x 512 x 128 weight-gradient GEMM 10x its AMX time.
void copy_rows(const bf16* a, int64_t rs, int64_t cs, int64_t rows, int64_t K, bf16* dst, int64_t ld) {
  if (rs < cs) {
    const int64_t m_tiled = rs == 1 ? rows / 16 * 16 : 0, k_tiled = rs == 1 ? K / 16 * 16 : 0;
    for (int64_t k = 0; k < k_tiled; k += 16)
      for (int64_t m = 0; m < m_tiled; m += 16) transpose_tile16<bf16>(a + k * cs + m, cs, dst + m * ld + k, ld);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t m = k < k_tiled ? m_tiled : 0; m < rows; ++m) dst[m * ld + k] = a[m * rs + k * cs];
  } else {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k) dst[m * ld + k] = a[m * rs + k * cs];
  }
}

// A buffer of this thread's, kept between calls: a fresh one of a few MB costs page faults (in our VM about as
// long as the GEMM it serves).
template <typename T>
T* scratch(std::vector<T>& kept, int64_t n) {
  if (static_cast<int64_t>(kept.size()) < n) kept.resize(n);
  return kept.data();
}

// A packed: copy_rows for each of `batch` items (dst_batch elements apart) into rows of ld elements, zeros past
// K and from `rows` up to `padded_rows`; chunks of rows spread over the threads.
void pack_rows(const bf16* a, int64_t a_batch, int64_t rs, int64_t cs, int64_t batch, int64_t rows, int64_t padded_rows,
               int64_t K, bf16* dst, int64_t dst_batch, int64_t ld) {
  constexpr int64_t CHUNK = 64;
  const int64_t chunks = (padded_rows + CHUNK - 1) / CHUNK;
  const bf16 zero(0.0f);
  at::parallel_for(0, batch * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bi = t / chunks, r0 = t % chunks * CHUNK, r1 = std::min(padded_rows, r0 + CHUNK);
      bf16* d = dst + bi * dst_batch;
      const int64_t copied = std::clamp<int64_t>(rows - r0, 0, r1 - r0);
      copy_rows(a + bi * a_batch + r0 * rs, rs, cs, copied, K, d + r0 * ld, ld);
      for (int64_t r = r0; r < r0 + copied; ++r) std::fill(d + r * ld + K, d + (r + 1) * ld, zero);
      std::fill(d + (r0 + copied) * ld, d + r1 * ld, zero);
    }
  });
}

// AVX512-BF16. A is read as words [m][pair] of bf16 rows (lda bf16 apart): in place when its k are
// contiguous and K is even, else packed once per call with K padded to even. B is read in one of two ways,
// both giving the micro-kernel words (b[2p][n], b[2p+1][n]) for 16 n per vector:
//  - B_ROWS: rows of n contiguous (a K-major weight, an activation): rows 2p and 2p+1 read in place and
//    interleaved by unpacklo/unpackhi_epi16, whose per-128-bit-lane order (columns 0-3, 8-11, .. in the
//    low vector, 4-7, 12-15, .. in the high) the accumulators keep until they are stored;
//  - B_WORDS: words [pairs][ldb] packed per K block (a weight as stored: 16 x 16 words transposed).
// Only which words sit in which register differs: every element takes its pairs in ascending order.
enum BRead { B_ROWS, B_WORDS };

inline uint32_t word_at(const bf16* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// Columns 32h + (0-3, 8-11, 16-19, 24-27) in lo and + (4-7, ..) in hi <-> columns 32h + 0-15 and + 16-31.
__attribute__((target("avx512f"))) inline void unpack_order_to_columns(__m512& lo, __m512& hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 a = _mm512_permutex2var_ps(lo, first, hi), b = _mm512_permutex2var_ps(lo, second, hi);
  lo = a;
  hi = b;
}
__attribute__((target("avx512f"))) inline void columns_to_unpack_order(__m512& first, __m512& second) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512 a = _mm512_permutex2var_ps(first, lo, second), b = _mm512_permutex2var_ps(first, hi, second);
  first = a;
  second = b;
}

// ROWS rows of A x 64 columns of B (`cols` of them real: a B_ROWS read masks the rest to zero) into c (ldc).
template <BRead READ, int ROWS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void micro_dpbf16(
    int64_t pairs, const bf16* a, int64_t lda, const void* b, int64_t ldb, int64_t cols, float* c, int64_t ldc,
    bool first) {
  constexpr int NV = 4;
  __m512 acc[ROWS][NV];
  UNROLLED for (int r = 0; r < ROWS; ++r) {
    UNROLLED for (int v = 0; v < NV; ++v) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + v * 16);
    if (READ == B_ROWS && !first)
      for (int v = 0; v < NV; v += 2) columns_to_unpack_order(acc[r][v], acc[r][v + 1]);
  }
  const __mmask32 mask0 = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  const __mmask32 mask1 = cols >= 64 ? ~__mmask32(0) : cols <= 32 ? 0 : (__mmask32(1) << (cols - 32)) - 1;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i bv[NV];
    if constexpr (READ == B_ROWS) {
      const bf16* even = static_cast<const bf16*>(b) + 2 * p * ldb;
      const bf16* odd = even + ldb;
      const __m512i e0 = _mm512_maskz_loadu_epi16(mask0, even), o0 = _mm512_maskz_loadu_epi16(mask0, odd);
      const __m512i e1 = _mm512_maskz_loadu_epi16(mask1, even + 32), o1 = _mm512_maskz_loadu_epi16(mask1, odd + 32);
      bv[0] = _mm512_unpacklo_epi16(e0, o0);
      bv[1] = _mm512_unpackhi_epi16(e0, o0);
      bv[2] = _mm512_unpacklo_epi16(e1, o1);
      bv[3] = _mm512_unpackhi_epi16(e1, o1);
    } else {
      const uint32_t* row = static_cast<const uint32_t*>(b) + p * ldb;
      UNROLLED for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_si512(row + v * 16);
    }
    UNROLLED for (int r = 0; r < ROWS; ++r) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(word_at(a + r * lda + 2 * p)));
      UNROLLED for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)av, (__m512bh)bv[v]);
    }
  }
  UNROLLED for (int r = 0; r < ROWS; ++r) {
    if (READ == B_ROWS)
      for (int v = 0; v < NV; v += 2) unpack_order_to_columns(acc[r][v], acc[r][v + 1]);
    UNROLLED for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
  }
}

template <BRead READ>
void micro_dpbf16_rows(int rows, int64_t pairs, const bf16* a, int64_t lda, const void* b, int64_t ldb,
                       int64_t cols, float* c, int64_t ldc, bool first) {
  switch (rows) {
    case 1: return micro_dpbf16<READ, 1>(pairs, a, lda, b, ldb, cols, c, ldc, first);
    case 2: return micro_dpbf16<READ, 2>(pairs, a, lda, b, ldb, cols, c, ldc, first);
    case 3: return micro_dpbf16<READ, 3>(pairs, a, lda, b, ldb, cols, c, ldc, first);
    case 4: return micro_dpbf16<READ, 4>(pairs, a, lda, b, ldb, cols, c, ldc, first);
    case 5: return micro_dpbf16<READ, 5>(pairs, a, lda, b, ldb, cols, c, ldc, first);
    case 6: return micro_dpbf16<READ, 6>(pairs, a, lda, b, ldb, cols, c, ldc, first);
  }
}

// B[k0:k0+kc, n0:n0+nc] -> words [pairs][ldb], zeros past kc and nc. Rows of n contiguous (cs == 1): two rows
// interleaved 32 columns at a time (unpack, then back to column order). A column of B contiguous along k (rs ==
// 1, a weight as stored) already holds its pairs as words: 16 x 16 words are transposed in registers.
__attribute__((target("avx512f,avx512bw"))) void pack_b_words(const bf16* b, int64_t rs, int64_t cs, int64_t kc,
                                                               int64_t nc, int64_t pairs, int64_t ldb, uint32_t* out) {
  if (cs == 1 && kc % 2 == 0) {
    // Rows far apart (a K-major vocabulary projection: 300 KB) are a new page and stream each: the hardware
    // prefetcher does not follow them, so the rows AHEAD pairs on are asked for while this pair is packed.
    constexpr int64_t AHEAD = 8;
    for (int64_t p = 0; p < pairs; ++p) {
      const bf16* even = b + 2 * p * rs;
      uint32_t* row = out + p * ldb;
      if (p + AHEAD < pairs)
        for (int64_t n = 0; n < nc; n += 32) {
          _mm_prefetch(reinterpret_cast<const char*>(even + 2 * AHEAD * rs + n), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(even + (2 * AHEAD + 1) * rs + n), _MM_HINT_T0);
        }
      for (int64_t n = 0; n < ldb; n += 32) {
        const int64_t left = std::clamp<int64_t>(nc - n, 0, 32);
        const __mmask32 mask = left == 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
        const __m512i e = _mm512_maskz_loadu_epi16(mask, even + n), o = _mm512_maskz_loadu_epi16(mask, even + rs + n);
        __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(e, o)), hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(e, o));
        unpack_order_to_columns(lo, hi);
        _mm512_storeu_ps(row + n, lo);
        _mm512_storeu_ps(row + n + 16, hi);
      }
    }
    return;
  }
  const bool tiles = rs == 1 && kc % 2 == 0;
  const int64_t n_tiled = tiles ? nc / 16 * 16 : 0, p_tiled = tiles ? pairs / 16 * 16 : 0;
  for (int64_t n = 0; n < n_tiled; n += 16)
    for (int64_t p = 0; p < p_tiled; p += 16) {
      // word (n, p) of the source sits at b + n * cs + 2p: a [n][p] matrix of words whose rows are cs bf16 apart
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(b + (n + i) * cs + 2 * p);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (p + i) * ldb + n, r[i]);
    }
  const bf16 zero(0.0f);
  for (int64_t p = 0; p < pairs; ++p) {
    uint32_t* row = out + p * ldb;
    const bool has_odd = 2 * p + 1 < kc;
    for (int64_t n = p < p_tiled ? n_tiled : 0; n < nc; ++n)
      row[n] = pair(b[2 * p * rs + n * cs], has_odd ? b[(2 * p + 1) * rs + n * cs] : zero);
    std::fill(row + nc, row + ldb, 0u);
  }
}

// out[b] = a[b] @ bm[b], bf16 x bf16 on AVX512-BF16, each MR x 64 micro-block resuming its fp32 accumulators
// from one K block (KC) to the next: in out.acc, or (out.acc null: a result rounded to bf16 or fp16) in a buffer
// of the task's own, rounded into the result when the block is complete. The lm_head's weight gradient
// ([151936, 256] x [256, 1024]) had a 622 MB fp32 buffer of its own to fault in and round from: 679 -> 300 ms.
void gemm_dpbf16(Strided a, Strided bm, int64_t batch, int64_t M, int64_t N, int64_t K, const Output& out) {
  constexpr int64_t width = 64, LOCAL_ROWS = 1024;
  // B's rows interleaved in the micro-kernel while a task makes one pass over them (decode), packed otherwise.
  const bool b_rows = bm.col == 1 && K % 2 == 0;
  const bool local = out.acc == nullptr;
  const Plan plan(batch, M, N, MR, local ? LOCAL_ROWS : 0);
  // A in place, or packed once: rows of K rounded up to even, the pad a zero the pair's partner multiplies.
  const bool a_in_place = a.col == 1 && K % 2 == 0;
  const int64_t lda = a_in_place ? a.row : K + K % 2, a_batch = a_in_place ? a.batch : M * lda;
  thread_local std::vector<bf16> apack;
  const bf16* a_data = static_cast<const bf16*>(a.data);
  if (!a_in_place) {
    bf16* packed = scratch(apack, batch * M * lda);
    pack_rows(a_data, a.batch, a.row, a.col, batch, M, M, K, packed, M * lda, lda);
    a_data = packed;
  }
  at::parallel_for(0, plan.tasks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint32_t> bpack;
    thread_local std::vector<float> tile, block;
    const int64_t ldb = (NC + width - 1) / width * width;
    bpack.resize(KC / 2 * ldb);
    tile.resize(MR * width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = plan.batch_item(task);
      const bf16* a_base = a_data + bi * a_batch;
      const bf16* b_base = static_cast<const bf16*>(bm.data) + bi * bm.batch;
      const int64_t n0 = plan.n0(task), nc = plan.nc(task, N);
      const int64_t m_lo = plan.m_lo(task), m_hi = plan.m_hi(task, M);
      // Row m of the task's C at c_rows + (m - m_lo) * ldc; the own buffer's rows are whole panels wide, so that
      // a partial panel needs no staging tile (its columns past nc are zeros times the pack's zero columns).
      const int64_t ldc = local ? (nc + width - 1) / width * width : N;
      float* c_rows = local ? scratch(block, (m_hi - m_lo) * ldc) : out.acc + bi * M * N + m_lo * N + n0;
      const bool staged = !local;
      // In place for one row only: from two rows on, packing (one pass over B) and reading the pack from cache
      // beats interleaving B's rows in every micro call (K-major N 3072 x K 1024, M 6: 25 -> 45 GB/s; N 151936,
      // M 4: 4.5 -> 15 GB/s).
      const bool in_place = b_rows && m_hi - m_lo == 1;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0), pairs = (kc + 1) / 2;
        const bf16* bk = b_base + k0 * bm.row + n0 * bm.col;
        if (!in_place) pack_b_words(bk, bm.row, bm.col, kc, nc, pairs, ldb, bpack.data());
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += MR) {
          const int rows = static_cast<int>(std::min<int64_t>(MR, m_hi - m0));
          const bf16* ap = a_base + m0 * lda + k0;
          float* c = c_rows + (m0 - m_lo) * ldc;
          for (int64_t j = 0; j < nc; j += width) {
            const int64_t cols = std::min(width, nc - j);
            const bool stage = staged && cols < width;  // a partial panel of out.acc: its zero columns are not kept
            float* cj = stage ? tile.data() : c + j;
            const int64_t ld = stage ? width : ldc;
            if (stage && k0 > 0)
              for (int r = 0; r < rows; ++r)
                for (int64_t q = 0; q < cols; ++q) tile[r * width + q] = c[r * ldc + j + q];
            if (in_place) micro_dpbf16_rows<B_ROWS>(rows, pairs, ap, lda, bk + j, bm.row, cols, cj, ld, k0 == 0);
            else micro_dpbf16_rows<B_WORDS>(rows, pairs, ap, lda, bpack.data() + j, ldb, cols, cj, ld, k0 == 0);
            if (stage)
              for (int r = 0; r < rows; ++r)
                for (int64_t q = 0; q < cols; ++q) c[r * ldc + j + q] = tile[r * width + q];
          }
        }
      }
      if (local && out.transposed)
        store_transposed(out, c_rows, ldc, bi, M, N, m_lo, m_hi, n0, nc);
      else if (local)
        for (int64_t r = m_lo; r < m_hi; ++r) out.write(c_rows + (r - m_lo) * ldc, bi * M * N + r * N + n0, nc);
      else
        out.finish(bi, M, N, m_lo, m_hi, n0, nc);
    }
  });
}

// AMX-BF16, in one of two forms; per element both take the same products (a product of two bf16 commutes)
// in the same order, 16 pairs per tdpbf16ps, pairs in ascending k, so the form never changes a bit:
//  - C^T = W X^T, when few rows meet a weight as stored (a B of row stride 1): the weight is read in place as
//    the tiles' A operand, 16 rows of 32 k each, so a decode step streams it once and packs only its few
//    activation rows;
//  - C = X W^T otherwise: A read in place as the tiles' A operand (or packed once), B packed per K block
//    into words (b[2p][n], b[2p+1][n]), the tiles' B operand, reused by every row block of the task; C
//    stays in the output between K blocks, resumed exactly as fp32.
// Tiles 0-3 hold a 32 x 32 block of the result, 4-5 two 16-row slices of the A operand, 6-7 two 16-column
// slices of the B operand.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // Not _tile_loadconfig: GCC 12's macro tells the compiler it reads 8 bytes, so the stores above vanish.
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

// ct (out): a 32 x 32 fp32 block of C^T at stride 32 floats, over all of K; w: 32 rows of `pairs` words,
// row_bytes apart (two tiles of 16 rows); x: `pairs` rows of 32 words at stride ldx. `pairs` is a
// multiple of 16.
__attribute__((target("amx-tile,amx-bf16"))) void micro_amx(int64_t pairs, const char* w, int64_t row_bytes,
                                                           const uint32_t* x, int64_t ldx, float* ct) {
  constexpr int64_t LDC = 32 * 4;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t p = 0; p < pairs; p += 16) {
    _tile_loadd(4, w + 4 * p, row_bytes);
    _tile_loadd(5, w + 16 * row_bytes + 4 * p, row_bytes);
    _tile_loadd(6, x + p * ldx, ldx * 4);
    _tile_loadd(7, x + p * ldx + 16, ldx * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, ct, LDC);
  _tile_stored(1, ct + 16, LDC);
  _tile_stored(2, ct + 16 * 32, LDC);
  _tile_stored(3, ct + 16 * 32 + 16, LDC);
}

// c (in/out): a 32 x 32 fp32 block at stride ldc floats, zeroed (first) or resumed; x: 32 rows of bf16 at
// stride lda, `pairs` words each; w: `pairs` rows of 32 words at stride ldw. `pairs` is a multiple of 16.
__attribute__((target("amx-tile,amx-bf16"))) void micro_amx_c(int64_t pairs, const bf16* x, int64_t lda,
                                                             const uint32_t* w, int64_t ldw, float* c, int64_t ldc,
                                                             bool first) {
  const int64_t cb = ldc * 4, xb = lda * 2, wb = ldw * 4;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, cb);
    _tile_loadd(1, c + 16, cb);
    _tile_loadd(2, c + 16 * ldc, cb);
    _tile_loadd(3, c + 16 * ldc + 16, cb);
  }
  for (int64_t p = 0; p < pairs; p += 16) {
    _tile_loadd(4, x + 2 * p, xb);
    _tile_loadd(5, x + 16 * lda + 2 * p, xb);
    _tile_loadd(6, w + p * ldw, wb);
    _tile_loadd(7, w + p * ldw + 16, wb);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, cb);
  _tile_stored(1, c + 16, cb);
  _tile_stored(2, c + 16 * ldc, cb);
  _tile_stored(3, c + 16 * ldc + 16, cb);
}

// dst[j][i] = src[i][j] for a 16 x 16 block of fp32 (unpack, then shuffles of pairs and of 128-bit lanes).
__attribute__((target("avx512f"))) void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ldd, r[i]);
}

// X[m0:m0+count, :] -> 32 columns of X^T's pairs at stride ldx: word (p, m) = (x[m][2p], x[m][2p+1]),
// zero columns past `count` and zero pairs past K. The loop runs along X's contiguous dimension.
void pack_x_pairs(const bf16* x, int64_t rs, int64_t cs, int64_t count, int64_t K, int64_t pairs, int64_t ldx,
                  uint32_t* out) {
  auto word = [&](int64_t m, int64_t p) { return pair_word(x, rs, cs, count, K, m, p); };
  if (cs < rs) {
    for (int64_t m = 0; m < 32; ++m)
      for (int64_t p = 0; p < pairs; ++p) out[p * ldx + m] = word(m, p);
  } else {
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t m = 0; m < 32; ++m) out[p * ldx + m] = word(m, p);
  }
}

// The C^T form, for a weight as stored (row stride 1, K a multiple of 32): first X^T's pairs, packed once
// per call (all of K, every row), then per task each 32 x 32 block of C^T stays in its tiles from the first
// k to the last and is stored once. The weight's 32 rows are read in place (a last partial 32 are packed).
void gemm_amx_ct(Strided a, Strided bm, int64_t batch, int64_t M, int64_t N, int64_t K, const Output& out) {
  constexpr int64_t BLOCK = 32;  // the C^T block: 32 weight rows x 32 activation rows
  const int64_t pairs = (K + 31) / 32 * 16, m_blocks = (M + BLOCK - 1) / BLOCK;
  const int64_t ldx = m_blocks * BLOCK + 16;  // off a power of two: a tile's 16 rows would share cache sets
  thread_local std::vector<uint32_t> xpack_kept;
  uint32_t* xpack = scratch(xpack_kept, batch * pairs * ldx);
  at::parallel_for(0, batch * m_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bi = t / m_blocks, m0 = (t % m_blocks) * BLOCK;
      pack_x_pairs(static_cast<const bf16*>(a.data) + bi * a.batch + m0 * a.row, a.row, a.col,
                   std::min(BLOCK, M - m0), K, pairs, ldx, xpack + bi * pairs * ldx + m0);
    }
  });
  const Plan plan(batch, M, N, BLOCK);
  at::parallel_for(0, plan.tasks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint32_t> wpack;
    thread_local std::vector<float> ct;
    wpack.resize(BLOCK * pairs);
    ct.resize(BLOCK * BLOCK);
    amx_configure();  // per chunk: other code (oneDNN) may have loaded its own tile configuration
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = plan.batch_item(task);
      const bf16* b_base = static_cast<const bf16*>(bm.data) + bi * bm.batch;
      const uint32_t* x = xpack + bi * pairs * ldx;
      float* c_base = out.acc + bi * M * N;
      const int64_t n0 = plan.n0(task), nc = plan.nc(task, N);
      const int64_t m_lo = plan.m_lo(task), m_hi = plan.m_hi(task, M);
      for (int64_t j = 0; j < nc; j += BLOCK) {
        const int64_t cols = std::min(BLOCK, nc - j);
        const bf16* wb = b_base + (n0 + j) * bm.col;
        const char* w = reinterpret_cast<const char*>(wb);
        int64_t row_bytes = bm.col * 2;
        if (cols < BLOCK) {
          pack_a_pairs(wb, bm.col, bm.row, cols, K, BLOCK, pairs, wpack.data());
          w = reinterpret_cast<const char*>(wpack.data());
          row_bytes = pairs * 4;
        }
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += BLOCK) {
          const int64_t rows = std::min(BLOCK, m_hi - m0);
          micro_amx(pairs, w, row_bytes, x + m0, ldx, ct.data());
          float* c = c_base + m0 * N + n0 + j;
          if (rows == BLOCK && cols == BLOCK) {
            for (int64_t rb = 0; rb < BLOCK; rb += 16)
              for (int64_t qb = 0; qb < BLOCK; qb += 16) transpose16(ct.data() + qb * BLOCK + rb, BLOCK, c + rb * N + qb, N);
          } else {
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t q = 0; q < cols; ++q) c[r * N + q] = ct[q * BLOCK + r];
          }
        }
      }
      out.finish(bi, M, N, m_lo, m_hi, n0, nc);
    }
    amx_release();
  });
}

// Rows [m_lo, m_hi) x columns [n0, n0 + nc) of C^T (item bi of [batch, M, N]; row m_lo's first column at `block`,
// rows ld apart) into C (o.rounded, [N, M], in o.dtype): 16 x 16 blocks transposed in registers, then each row
// of C rounded (or copied) as a task's block of C would be.
void store_transposed(const Output& o, const float* block, int64_t ld, int64_t bi, int64_t M, int64_t N, int64_t m_lo,
                      int64_t m_hi, int64_t n0, int64_t nc) {
  float tile[16 * 16];
  for (int64_t m = m_lo; m < m_hi; m += 16)
    for (int64_t n = n0; n < n0 + nc; n += 16) {
      const int64_t rows = std::min<int64_t>(16, m_hi - m), cols = std::min<int64_t>(16, n0 + nc - n);
      const float* src = block + (m - m_lo) * ld + (n - n0);
      if (rows == 16 && cols == 16) transpose16(src, ld, tile, 16);
      else
        for (int64_t j = 0; j < cols; ++j)
          for (int64_t i = 0; i < rows; ++i) tile[j * 16 + i] = src[i * ld + j];
      for (int64_t j = 0; j < cols; ++j) o.write(tile + j * 16, bi * M * N + (n + j) * M + m, rows);
    }
}

// The C form: A's rows read in place when they hold whole 32-k tiles (k contiguous, K a multiple of 32), else
// packed once with K rounded up to 32 by zeros; a last partial 32-row block is always such a packed copy.
// Per task and K block (KC_AMX), B's block is packed into words once and swept by each 32-row block of A. A K
// block of 2048 (B's block 1 MB, in L2) leaves a real model's C blocks in their tiles from the first k to the
// last; at 512 their loads and stores between blocks took 30 % of the micro-kernel (M 1024 K 2048 N 1024, 2
// threads: 1342 -> 1922 GFLOP/s).
void gemm_amx_c(Strided a, Strided bm, int64_t batch, int64_t M, int64_t N, int64_t K, const Output& out) {
  constexpr int64_t BLOCK = 32, KC_AMX = 2048;
  const int64_t k32 = (K + 31) / 32 * 32;
  const bool a_in_place = a.col == 1 && K % 32 == 0;
  const int64_t m_in_place = a_in_place ? M / BLOCK * BLOCK : 0;
  const int64_t packed_rows = (M - m_in_place + BLOCK - 1) / BLOCK * BLOCK;
  thread_local std::vector<bf16> apack_kept;
  bf16* apack = scratch(apack_kept, batch * packed_rows * k32);
  pack_rows(static_cast<const bf16*>(a.data) + m_in_place * a.row, a.batch, a.row, a.col, batch, M - m_in_place,
            packed_rows, K, apack, packed_rows * k32, k32);
  const Plan plan(batch, M, N, BLOCK);
  at::parallel_for(0, plan.tasks, 1, [&](int64_t begin, int64_t end) {
    // B's block as panels of 32 columns, each [pairs][32 words] contiguous: a tile's 16 rows are 1 KB in a row.
    constexpr int64_t PANEL = 32;
    thread_local std::vector<uint32_t> wpack;
    thread_local std::vector<float> stage;
    wpack.resize(KC_AMX / 2 * ((NC + PANEL - 1) / PANEL) * PANEL);
    stage.resize(BLOCK * BLOCK);
    amx_configure();  // per chunk: other code (oneDNN) may have loaded its own tile configuration
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = plan.batch_item(task);
      const bf16* a_base = static_cast<const bf16*>(a.data) + bi * a.batch;
      const bf16* a_packed = apack + bi * packed_rows * k32;
      const bf16* b_base = static_cast<const bf16*>(bm.data) + bi * bm.batch;
      float* c_base = out.acc + bi * M * N;
      const int64_t n0 = plan.n0(task), nc = plan.nc(task, N);
      const int64_t m_lo = plan.m_lo(task), m_hi = plan.m_hi(task, M);
      for (int64_t k0 = 0; k0 < K; k0 += KC_AMX) {
        const int64_t kc = std::min(KC_AMX, K - k0), pairs = (kc + 1) / 2, tile_pairs = (pairs + 15) / 16 * 16;
        for (int64_t j = 0; j < nc; j += PANEL) {
          uint32_t* panel = wpack.data() + j * tile_pairs;
          pack_b_words(b_base + k0 * bm.row + (n0 + j) * bm.col, bm.row, bm.col, kc, std::min(PANEL, nc - j), pairs, PANEL,
                       panel);
          std::fill(panel + pairs * PANEL, panel + tile_pairs * PANEL, 0u);
        }
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += BLOCK) {
          const int64_t rows = std::min(BLOCK, M - m0);
          const bool in_place = m0 + BLOCK <= m_in_place;
          const bf16* x = in_place ? a_base + m0 * a.row + k0 : a_packed + (m0 - m_in_place) * k32 + k0;
          const int64_t lda = in_place ? a.row : k32;
          for (int64_t j = 0; j < nc; j += BLOCK) {
            const int64_t cols = std::min(BLOCK, nc - j);
            float* c = c_base + m0 * N + n0 + j;
            if (rows == BLOCK && cols == BLOCK) {
              micro_amx_c(tile_pairs, x, lda, wpack.data() + j * tile_pairs, PANEL, c, N, k0 == 0);
            } else {  // a partial block runs on a staging block; its padding rows and columns are not kept
              if (k0 > 0)
                for (int64_t r = 0; r < rows; ++r) std::copy(c + r * N, c + r * N + cols, stage.data() + r * BLOCK);
              micro_amx_c(tile_pairs, x, lda, wpack.data() + j * tile_pairs, PANEL, stage.data(), BLOCK, k0 == 0);
              for (int64_t r = 0; r < rows; ++r)
                std::copy(stage.data() + r * BLOCK, stage.data() + r * BLOCK + cols, c + r * N);
            }
          }
          if (k0 + KC_AMX >= K) out.finish(bi, M, N, m0, m0 + rows, n0, nc);  // while the rows are in L1 or L2
        }
      }
    }
    amx_release();
  });
}

// The weight in place pays while few rows meet many of its rows (a decode step, a vocabulary projection);
// past that, packing B once per K block for all of a task's row blocks does. Measured (2 threads, Sapphire
// Rapids), C^T vs C in GFLOP/s: M 64 K 2048 N 6144 1331 vs 793, M 256 K 512 N 16384 1614 vs 1354, M 512 K 2048
// N 6144 1172 vs 1275, M 1024 K 512 N 512 749 vs 1069. A choice of speed: the two forms give the same bits.
bool amx_ct_pays(int64_t M, int64_t N) { return M <= 32 || N >= 16 * M; }

void gemm_amx(Strided a, Strided bm, int64_t batch, int64_t M, int64_t N, int64_t K, const Output& out) {
  if (bm.row == 1 && K % 32 == 0 && amx_ct_pays(M, N)) gemm_amx_ct(a, bm, batch, M, N, K, out);
  else gemm_amx_c(a, bm, batch, M, N, K, out);
}

template <typename TA>
void gemm_b(Tier tier, Strided a, Strided b, at::ScalarType tb, int64_t batch, int64_t M, int64_t N, int64_t K,
            const Output& out) {
  switch (tb) {
    case at::kFloat: return gemm<TA, float>(tier, a, b, batch, M, N, K, out);
    case at::kBFloat16: return gemm<TA, c10::BFloat16>(tier, a, b, batch, M, N, K, out);
    case at::kHalf: return gemm<TA, c10::Half>(tier, a, b, batch, M, N, K, out);
    default: TORCH_CHECK(false, "logdiff mm: B must be float32, bfloat16 or float16, got ", tb);
  }
}

bool cpuid_bit(unsigned leaf, unsigned subleaf, int reg, int bit) {
  unsigned r[4];
  if (!__get_cpuid_count(leaf, subleaf, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1;
}

// Linux hands out the AMX tile state only to a process that asks for it.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

bool cpu_has(Tier tier) {
  __builtin_cpu_init();
  constexpr int EAX = 0, EDX = 3;
  switch (tier) {
    case PORTABLE: return true;
    case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case AVX512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    case AVX512_BF16: return cpu_has(AVX512) && cpuid_bit(7, 1, EAX, 5);
    case AMX_BF16: return cpuid_bit(7, 0, EDX, 22) && cpuid_bit(7, 0, EDX, 24) && amx_permitted();
  }
  return false;
}

// Asked once per process: CPUID traps to the hypervisor in a VM (measured 20 us a call, more than a decode
// step's expert GEMM).
bool tier_runs(int64_t tier) {
  static const auto runs = [] {
    std::array<bool, AMX_BF16 + 1> r{};
    for (int t = PORTABLE; t <= AMX_BF16; ++t) r[t] = cpu_has(static_cast<Tier>(t));
    return r;
  }();
  return tier >= PORTABLE && tier <= AMX_BF16 && runs[tier];
}

// fp32 space for accumulators: this thread's kept buffer (a fresh one of a few MB costs page faults, in our VM
// about as long as the GEMM), or past 64 MiB one of the caller's own, so that a vocabulary-sized result does not
// stay resident.
float* accumulators(std::vector<float>& kept, at::Tensor& own, int64_t n) {
  constexpr int64_t KEEP = 16 << 20;
  if (n <= KEEP) return scratch(kept, n);
  own = at::empty({n}, at::kFloat);
  return own.data_ptr<float>();
}

// A GEMM's result [batch, M, N] at `result`, in `dtype`: fp32 accumulated in place, bf16 or fp16 accumulated
// in fp32 `accumulators` and rounded into it.
class Result {
 public:
  // blockwise: the tier's tasks may keep their blocks of a rounded result's accumulators in buffers of their own
  // (AVX512-BF16, when no chunk sum reads them).
  Result(void* result, at::ScalarType dtype, Tier tier, int64_t n, bool blockwise) {
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "logdiff mm: the result must be float32, bfloat16 or float16, got ", dtype);
    out_.dtype = dtype;
    out_.tier = tier;
    if (dtype == at::kFloat) {
      out_.acc = static_cast<float*>(result);
      return;
    }
    out_.rounded = result;
    if (blockwise && tier == AVX512_BF16) return;
    thread_local std::vector<float> kept;
    out_.acc = accumulators(kept, own_, n);
  }
  const Output& output() const { return out_; }

 private:
  Output out_{nullptr};
  at::Tensor own_;
};

// `out` = a @ b on tier t.
void run(Tier t, Strided sa, at::ScalarType ta, Strided sb, at::ScalarType tb, int64_t batch, int64_t M, int64_t N,
         int64_t K, const Output& o) {
  if (t == AVX512_BF16 || t == AMX_BF16) {
    TORCH_CHECK(ta == at::kBFloat16 && tb == at::kBFloat16, "logdiff mm: the bf16 tiers take bfloat16 operands only");
    if (t == AMX_BF16) gemm_amx(sa, sb, batch, M, N, K, o);
    else gemm_dpbf16(sa, sb, batch, M, N, K, o);
    return;
  }
  switch (ta) {
    case at::kFloat: return gemm_b<float>(t, sa, sb, tb, batch, M, N, K, o);
    case at::kBFloat16: return gemm_b<c10::BFloat16>(t, sa, sb, tb, batch, M, N, K, o);
    case at::kHalf: return gemm_b<c10::Half>(t, sa, sb, tb, batch, M, N, K, o);
    default: TORCH_CHECK(false, "logdiff mm: A must be float32, bfloat16 or float16, got ", ta);
  }
}

// `out` ([batch, M, N] contiguous, in `dtype`) = a @ b on tier t; zero where K is 0. A raw pointer, not a tensor:
// a grouped call runs this for each of its groups, and a tensor view per group (narrow, select) cost a decode
// step's 64-expert call more than its 8 active experts' GEMMs.
void run_into(void* out, at::ScalarType dtype, Tier t, Strided sa, at::ScalarType ta, Strided sb, at::ScalarType tb,
              int64_t batch, int64_t M, int64_t N, int64_t K) {
  if (batch * M * N == 0) return;
  if (K == 0) {
    std::memset(out, 0, batch * M * N * at::elementSize(dtype));  // +0 is all zero bits in every dtype
    return;
  }
  // Both operands with k strided (a transposed activation times rows of one: a weight gradient) on the bf16 tiers,
  // which want k contiguous in the A operand: that operand is packed by transposing it, and when B is the
  // smaller, C^T = B^T A^T packs B instead and stores its blocks transposed (the same products, summed in the
  // same order: the same bits). The lm_head's gradient, [V, T] x [T, H]: AMX 17.9 -> 9 ms (V 16384, T 256,
  // H 512), AVX512-BF16 300 -> 200 ms (V 151936, H 1024; torch 184 ms).
  if ((t == AMX_BF16 || t == AVX512_BF16) && sa.row == 1 && sa.col != 1 && sb.col == 1 && M > N) {
    thread_local std::vector<float> kept;
    at::Tensor own;
    // AVX512-BF16's tasks keep their blocks of C^T in buffers of their own (acc null)
    float* acc = t == AMX_BF16 ? accumulators(kept, own, batch * M * N) : nullptr;
    Output o{acc, nullptr, out, dtype, t};
    o.transposed = true;
    run(t, {sb.data, sb.batch, sb.col, sb.row}, tb, {sa.data, sa.batch, sa.col, sa.row}, ta, batch, N, M, K, o);
    return;
  }
  const Result result(out, dtype, t, batch * M * N, true);
  run(t, sa, ta, sb, tb, batch, M, N, K, result.output());
}

// a [batch, M, K], b [batch, K, N], any strides -> [batch, M, N] in out_dtype; or 2-d, one batch item.
at::Tensor mm(const at::Tensor& a, const at::Tensor& b, int64_t tier, at::ScalarType out_dtype) {
  TORCH_CHECK(a.dim() == b.dim() && (a.dim() == 2 || a.dim() == 3), "logdiff mm: two 2-d or two 3-d operands expected");
  const bool batched = a.dim() == 3;
  TORCH_CHECK((!batched || a.size(0) == b.size(0)) && a.size(-1) == b.size(-2), "logdiff mm: shapes ", a.sizes(),
              " and ", b.sizes(), " do not multiply");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "logdiff mm: CPU tensors expected");
  TORCH_CHECK(tier_runs(tier), "logdiff mm: tier ", tier, " does not run on this CPU");
  const int64_t batch = batched ? a.size(0) : 1, M = a.size(-2), K = a.size(-1), N = b.size(-1);
  at::Tensor out = batched ? at::empty({batch, M, N}, a.options().dtype(out_dtype))
                           : at::empty({M, N}, a.options().dtype(out_dtype));
  run_into(out.data_ptr(), out_dtype, static_cast<Tier>(tier), {a.data_ptr(), batched ? a.stride(0) : 0, a.stride(-2), a.stride(-1)},
           a.scalar_type(), {b.data_ptr(), batched ? b.stride(0) : 0, b.stride(-2), b.stride(-1)}, b.scalar_type(),
           batch, M, N, K);
  return out;
}

// out = the fp32 sum, in chunk order, of `chunks` GEMMs a[:, K chunk c] @ b[K chunk c, :] (K cut into equal
// chunks), each reduced from zero as a GEMM of its own, rounded once to out_dtype: what the ranks of a
// row-parallel layer compute and add in rank order, in one call. Each task adds its block of a chunk into the
// sum, and rounds it after the last, while the block is in cache.
at::Tensor mm_chunked(const at::Tensor& a, const at::Tensor& b, int64_t tier, at::ScalarType out_dtype, int64_t chunks) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "logdiff mm_chunked: a [M, K] and b [K, N] "
              "expected, got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(chunks > 0 && a.size(1) % chunks == 0, "logdiff mm_chunked: K ", a.size(1), " does not split into ",
              chunks, " chunks");
  TORCH_CHECK(tier_runs(tier), "logdiff mm: tier ", tier, " does not run on this CPU");
  const int64_t M = a.size(0), N = b.size(1), width = a.size(1) / chunks;
  at::Tensor out = at::empty({M, N}, a.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  if (width == 0) return out.zero_();
  const Result result(out.data_ptr(), out_dtype, static_cast<Tier>(tier), M * N, false);
  thread_local std::vector<float> kept;
  at::Tensor own;
  float* stage = accumulators(kept, own, M * N);
  for (int64_t c = 0; c < chunks; ++c) {
    Output o = result.output();
    if (c > 0) {
      o.total = o.acc;
      o.acc = stage;
    }
    if (c + 1 < chunks) o.rounded = nullptr;
    const char* ac = static_cast<const char*>(a.data_ptr()) + c * width * a.stride(1) * a.element_size();
    const char* bc = static_cast<const char*>(b.data_ptr()) + c * width * b.stride(0) * b.element_size();
    run(static_cast<Tier>(tier), {ac, 0, a.stride(0), a.stride(1)}, a.scalar_type(), {bc, 0, b.stride(0), b.stride(1)},
        b.scalar_type(), 1, M, N, width, o);
  }
  return out;
}

// Row ranges of a grouped operand: offsets [E + 1], int64, from 0 up to `rows`.
std::vector<int64_t> group_offsets(const at::Tensor& offsets, int64_t rows) {
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.device().is_cpu(),
              "logdiff grouped mm: offsets must be a 1-d int64 CPU tensor");
  const at::Tensor o = offsets.contiguous();
  std::vector<int64_t> v(o.data_ptr<int64_t>(), o.data_ptr<int64_t>() + o.numel());
  TORCH_CHECK(!v.empty() && v.front() == 0 && v.back() == rows, "logdiff grouped mm: offsets must run from 0 to ", rows);
  for (size_t e = 1; e < v.size(); ++e) TORCH_CHECK(v[e - 1] <= v[e], "logdiff grouped mm: offsets must not decrease");
  return v;
}

void* row_at(const at::Tensor& t, int64_t row) {
  return static_cast<char*>(t.data_ptr()) + row * t.stride(0) * t.element_size();
}

// Runs group(e) for every group; those with no rows first, on this thread (nothing, or a zero fill). Many
// groups with rows, none with more than a thread's share of the rows: a thread takes whole groups (each GEMM
// then runs on its thread alone, no synchronisation per group), the groups with rows dealt out evenly (a decode
// step's 8 experts of 64: 4 and 4, not as they fall in the first and second half of the 64); else the groups
// go one after the other on every thread. Which thread computes a group never changes a bit.
template <typename F>
void in_groups(int64_t groups, const std::vector<int64_t>& off, int64_t rows, const F& group) {
  std::vector<int64_t> busy;
  int64_t most = 0;
  for (int64_t e = 0; e < groups; ++e) {
    if (off[e + 1] == off[e]) {
      group(e);
      continue;
    }
    busy.push_back(e);
    most = std::max(most, off[e + 1] - off[e]);
  }
  const int64_t count = static_cast<int64_t>(busy.size()), threads = at::get_num_threads();
  if (count >= 4 * threads && most * threads <= rows) {
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) group(busy[i]);
    });
  } else {
    for (int64_t e : busy) group(e);
  }
}

// out[rows of group e] = a[rows of group e] @ b[e]: a [T, K], b [E, K, N] -> [T, N] in out_dtype. Per group
// the very GEMM `mm` runs, rounded as `mm` rounds, so a row's bits are those of `mm` on its group's weight.
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets, int64_t tier,
                      at::ScalarType out_dtype) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3 && a.size(1) == b.size(1), "logdiff grouped mm: a [T, K] and b [E, K, N] "
              "expected, got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(tier_runs(tier), "logdiff mm: tier ", tier, " does not run on this CPU");
  const std::vector<int64_t> off = group_offsets(offsets, a.size(0));
  TORCH_CHECK(static_cast<int64_t>(off.size()) == b.size(0) + 1, "logdiff grouped mm: ", b.size(0), " groups need ",
              b.size(0) + 1, " offsets");
  const int64_t K = a.size(1), N = b.size(2), groups = b.size(0);
  at::Tensor out = at::empty({a.size(0), N}, a.options().dtype(out_dtype));
  auto group = [&](int64_t e) {
    const int64_t M = off[e + 1] - off[e];
    run_into(row_at(out, off[e]), out_dtype, static_cast<Tier>(tier), {row_at(a, off[e]), 0, a.stride(0), a.stride(1)},
             a.scalar_type(), {row_at(b, e), 0, b.stride(1), b.stride(2)}, b.scalar_type(), 1, M, N, K);
  };
  in_groups(groups, off, a.size(0), group);
  return out;
}

// out[e] = x[rows of group e]^T @ y[rows of group e]: x [T, P], y [T, Q] -> [E, P, Q] in out_dtype, each reduced
// over its group's rows in ascending order and rounded as `mm` rounds (a weight gradient of `grouped_mm`; zero
// for a group with no rows).
at::Tensor grouped_mm_tn(const at::Tensor& x, const at::Tensor& y, const at::Tensor& offsets, int64_t tier,
                         at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "logdiff grouped mm: x [T, P] and y [T, Q] "
              "expected, got ", x.sizes(), " and ", y.sizes());
  TORCH_CHECK(tier_runs(tier), "logdiff mm: tier ", tier, " does not run on this CPU");
  const std::vector<int64_t> off = group_offsets(offsets, x.size(0));
  const int64_t groups = static_cast<int64_t>(off.size()) - 1, P = x.size(1), Q = y.size(1);
  at::Tensor out = at::empty({groups, P, Q}, x.options().dtype(out_dtype));
  auto group = [&](int64_t e) {  // x's rows of the group, transposed
    run_into(row_at(out, e), out_dtype, static_cast<Tier>(tier), {row_at(x, off[e]), 0, x.stride(1), x.stride(0)},
             x.scalar_type(), {row_at(y, off[e]), 0, y.stride(0), y.stride(1)}, y.scalar_type(), 1, P, Q,
             off[e + 1] - off[e]);
  };
  in_groups(groups, off, x.size(0), group);
  return out;
}

}  // namespace

TORCH_LIBRARY(logdiff, m) {
  m.def("mm(Tensor a, Tensor b, int tier, ScalarType out_dtype) -> Tensor", &mm);
  m.def("mm_chunked(Tensor a, Tensor b, int tier, ScalarType out_dtype, int chunks) -> Tensor", &mm_chunked);
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offsets, int tier, ScalarType out_dtype) -> Tensor", &grouped_mm);
  m.def("grouped_mm_tn(Tensor x, Tensor y, Tensor offsets, int tier, ScalarType out_dtype) -> Tensor", &grouped_mm_tn);
  m.def("tier_runs(int tier) -> bool", &tier_runs);
}
