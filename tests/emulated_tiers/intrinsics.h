// Scalar stand-ins for the AVX-512, AVX512-BF16 and AMX intrinsics of kernels/csrc, so that a CPU without them
// runs those tiers' blocking, packing, tile layouts and thread splits (run.py rewrites the sources to call these).
// They check the C++ around the instructions, not the instructions: vdpbf16ps and tdpbf16ps follow the order of
// Intel's pseudocode (a pair's odd product added first for vdpbf16ps, its even one for tdpbf16ps), not the silicon.
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

struct emu_m512 {
  float f[16];
};
struct emu_m512i {
  union {
    int32_t i[16];
    uint32_t u[16];
    uint16_t h[32];
  };
};

template <typename V>
inline V emu_load(const void* p) {
  V r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

template <typename To, typename From>
inline To emu_bits(const From& v) {
  static_assert(sizeof(To) == sizeof(From));
  return emu_load<To>(&v);
}

inline float emu_widen_bf16(uint16_t h) { return emu_bits<float>(uint32_t(h) << 16); }

// ---- fp32 lanes
inline emu_m512 emu_mm512_setzero_ps() { return emu_m512{}; }
inline emu_m512 emu_mm512_set1_ps(float x) {
  emu_m512 r;
  for (float& f : r.f) f = x;
  return r;
}
inline emu_m512 emu_mm512_loadu_ps(const void* p) { return emu_load<emu_m512>(p); }
inline void emu_mm512_storeu_ps(void* p, emu_m512 v) { std::memcpy(p, &v, sizeof(v)); }
inline emu_m512 emu_mm512_fmadd_ps(emu_m512 a, emu_m512 b, emu_m512 c) {
  for (int i = 0; i < 16; ++i) c.f[i] = std::fma(a.f[i], b.f[i], c.f[i]);
  return c;
}
inline emu_m512 emu_mm512_castsi512_ps(emu_m512i v) { return emu_bits<emu_m512>(v); }
inline emu_m512i emu_mm512_castps_si512(emu_m512 v) { return emu_bits<emu_m512i>(v); }
inline emu_m512 emu_mm512_cvtph_ps(__m256i halves) {
  const auto h = emu_bits<std::array<uint16_t, 16>>(halves);
  emu_m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
  return r;
}
inline uint16_t emu_mm512_cmp_ps_mask(emu_m512 a, emu_m512 b, int predicate) {
  if (predicate != _CMP_UNORD_Q) std::abort();  // the only predicate kernels/csrc uses
  uint16_t k = 0;
  for (int i = 0; i < 16; ++i) k |= uint16_t(std::isnan(a.f[i]) || std::isnan(b.f[i])) << i;
  return k;
}

// ---- 32-bit and 16-bit integer lanes
inline emu_m512i emu_mm512_set1_epi32(int x) {
  emu_m512i r;
  for (int32_t& v : r.i) v = x;
  return r;
}
inline emu_m512i emu_mm512_setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9,
                                      int a10, int a11, int a12, int a13, int a14, int a15) {
  emu_m512i r;
  const int v[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
  for (int i = 0; i < 16; ++i) r.i[i] = v[i];
  return r;
}
inline emu_m512i emu_mm512_loadu_si512(const void* p) { return emu_load<emu_m512i>(p); }
inline void emu_mm512_storeu_si512(void* p, emu_m512i v) { std::memcpy(p, &v, sizeof(v)); }
inline emu_m512i emu_mm512_maskz_loadu_epi16(uint32_t k, const void* p) {  // reads only the words k selects
  emu_m512i r;
  const auto* w = static_cast<const uint16_t*>(p);
  for (int i = 0; i < 32; ++i) r.h[i] = (k >> i) & 1 ? w[i] : 0;
  return r;
}
inline emu_m512i emu_mm512_mask_mov_epi32(emu_m512i src, uint16_t k, emu_m512i a) {
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) src.u[i] = a.u[i];
  return src;
}
inline emu_m512i emu_mm512_slli_epi32(emu_m512i v, unsigned n) {
  for (uint32_t& u : v.u) u = n > 31 ? 0 : u << n;
  return v;
}
inline emu_m512i emu_mm512_srli_epi32(emu_m512i v, unsigned n) {
  for (uint32_t& u : v.u) u = n > 31 ? 0 : u >> n;
  return v;
}
inline emu_m512i emu_mm512_add_epi32(emu_m512i a, emu_m512i b) {
  for (int i = 0; i < 16; ++i) a.u[i] += b.u[i];
  return a;
}
inline emu_m512i emu_mm512_and_si512(emu_m512i a, emu_m512i b) {
  for (int i = 0; i < 16; ++i) a.u[i] &= b.u[i];
  return a;
}
inline emu_m512i emu_mm512_cvtepu16_epi32(__m256i words) {
  const auto w = emu_bits<std::array<uint16_t, 16>>(words);
  emu_m512i r;
  for (int i = 0; i < 16; ++i) r.u[i] = w[i];
  return r;
}
inline __m256i emu_mm512_cvtepi32_epi16(emu_m512i v) {  // truncates, as vpmovdw does
  std::array<uint16_t, 16> w;
  for (int i = 0; i < 16; ++i) w[i] = uint16_t(v.u[i]);
  return emu_bits<__m256i>(w);
}

// ---- permutes; the unpacks and shuffle_ps work within each 128-bit lane
// Each 128-bit lane: the low (or high) half of a's and of b's elements there, interleaved, a's first.
template <typename Elem>
inline emu_m512i emu_unpack(emu_m512i a, emu_m512i b, bool high) {
  constexpr int PER_LANE = 16 / sizeof(Elem), HALF = PER_LANE / 2;
  using Elems = std::array<Elem, 64 / sizeof(Elem)>;
  const auto x = emu_bits<Elems>(a), y = emu_bits<Elems>(b);
  Elems r;
  for (int l = 0; l < 4; ++l)
    for (int i = 0; i < HALF; ++i) {
      r[l * PER_LANE + 2 * i] = x[l * PER_LANE + high * HALF + i];
      r[l * PER_LANE + 2 * i + 1] = y[l * PER_LANE + high * HALF + i];
    }
  return emu_bits<emu_m512i>(r);
}
inline emu_m512i emu_mm512_unpacklo_epi16(emu_m512i a, emu_m512i b) { return emu_unpack<uint16_t>(a, b, false); }
inline emu_m512i emu_mm512_unpackhi_epi16(emu_m512i a, emu_m512i b) { return emu_unpack<uint16_t>(a, b, true); }
inline emu_m512i emu_mm512_unpacklo_epi32(emu_m512i a, emu_m512i b) { return emu_unpack<uint32_t>(a, b, false); }
inline emu_m512i emu_mm512_unpackhi_epi32(emu_m512i a, emu_m512i b) { return emu_unpack<uint32_t>(a, b, true); }
inline emu_m512i emu_mm512_unpacklo_epi64(emu_m512i a, emu_m512i b) { return emu_unpack<uint64_t>(a, b, false); }
inline emu_m512i emu_mm512_unpackhi_epi64(emu_m512i a, emu_m512i b) { return emu_unpack<uint64_t>(a, b, true); }
inline emu_m512 emu_mm512_unpacklo_ps(emu_m512 a, emu_m512 b) {
  return emu_mm512_castsi512_ps(emu_mm512_unpacklo_epi32(emu_mm512_castps_si512(a), emu_mm512_castps_si512(b)));
}
inline emu_m512 emu_mm512_unpackhi_ps(emu_m512 a, emu_m512 b) {
  return emu_mm512_castsi512_ps(emu_mm512_unpackhi_epi32(emu_mm512_castps_si512(a), emu_mm512_castps_si512(b)));
}
inline emu_m512 emu_mm512_shuffle_ps(emu_m512 a, emu_m512 b, int imm) {
  emu_m512 r;
  for (int l = 0; l < 4; ++l)
    for (int i = 0; i < 4; ++i) r.f[4 * l + i] = (i < 2 ? a : b).f[4 * l + ((imm >> (2 * i)) & 3)];
  return r;
}
inline emu_m512i emu_mm512_shuffle_i32x4(emu_m512i a, emu_m512i b, int imm) {  // whole 128-bit lanes
  emu_m512i r;
  for (int l = 0; l < 4; ++l) std::memcpy(&r.u[4 * l], &(l < 2 ? a : b).u[4 * ((imm >> (2 * l)) & 3)], 16);
  return r;
}
inline emu_m512 emu_mm512_shuffle_f32x4(emu_m512 a, emu_m512 b, int imm) {
  return emu_mm512_castsi512_ps(emu_mm512_shuffle_i32x4(emu_mm512_castps_si512(a), emu_mm512_castps_si512(b), imm));
}
inline emu_m512 emu_mm512_permutex2var_ps(emu_m512 a, emu_m512i idx, emu_m512 b) {
  emu_m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = (idx.u[i] & 16 ? b : a).f[idx.u[i] & 15];
  return r;
}

// ---- vdpbf16ps
inline emu_m512 emu_mm512_dpbf16_ps(emu_m512 acc, emu_m512i a, emu_m512i b) {
  for (int i = 0; i < 16; ++i) {
    acc.f[i] += emu_widen_bf16(a.h[2 * i + 1]) * emu_widen_bf16(b.h[2 * i + 1]);
    acc.f[i] += emu_widen_bf16(a.h[2 * i]) * emu_widen_bf16(b.h[2 * i]);
  }
  return acc;
}

// ---- AMX: eight tiles per thread, shaped by the last ldtilecfg
struct EmuTiles {
  unsigned char data[8][16][64];
  uint8_t rows[16];
  uint16_t colsb[16];
};
inline thread_local EmuTiles emu_tiles;

inline void emu_tile_config(const uint8_t* rows, const uint16_t* colsb) {
  std::memcpy(emu_tiles.rows, rows, sizeof(emu_tiles.rows));
  std::memcpy(emu_tiles.colsb, colsb, sizeof(emu_tiles.colsb));
}
inline void emu_tile_release() {}
inline void emu_tile_zero(int t) { std::memset(emu_tiles.data[t], 0, sizeof(emu_tiles.data[t])); }
inline void emu_tile_loadd(int t, const void* base, int64_t stride) {
  for (int r = 0; r < emu_tiles.rows[t]; ++r)
    std::memcpy(emu_tiles.data[t][r], static_cast<const char*>(base) + r * stride, emu_tiles.colsb[t]);
}
inline void emu_tile_stored(int t, void* base, int64_t stride) {
  for (int r = 0; r < emu_tiles.rows[t]; ++r)
    std::memcpy(static_cast<char*>(base) + r * stride, emu_tiles.data[t][r], emu_tiles.colsb[t]);
}
inline void emu_tile_dpbf16ps(int c, int a, int b) {
  for (int m = 0; m < emu_tiles.rows[c]; ++m) {
    auto* row = reinterpret_cast<float*>(emu_tiles.data[c][m]);
    const auto* am = reinterpret_cast<const uint16_t*>(emu_tiles.data[a][m]);
    for (int k = 0; k < emu_tiles.colsb[a] / 4; ++k) {
      const auto* bk = reinterpret_cast<const uint16_t*>(emu_tiles.data[b][k]);
      for (int n = 0; n < emu_tiles.colsb[c] / 4; ++n) {
        row[n] += emu_widen_bf16(am[2 * k]) * emu_widen_bf16(bk[2 * n]);
        row[n] += emu_widen_bf16(am[2 * k + 1]) * emu_widen_bf16(bk[2 * n + 1]);
      }
    }
  }
}
