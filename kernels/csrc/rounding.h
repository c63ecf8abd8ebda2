// Widening operands to fp32 and rounding an fp32 result back as torch's `.to` does, for logdiff's C++ kernels
// (one rounding each).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace logdiff {

// A bf16 from an fp32 as torch's `.to` rounds: to nearest even, any NaN as 0xffff.
inline c10::BFloat16 to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return c10::BFloat16(std::isnan(x) ? uint16_t(0xffff) : uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16),
                       c10::BFloat16::from_bits());
}

// to_bf16 16 at a time.
__attribute__((target("avx512f,avx512bw"))) inline void round_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xffff));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
  for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}

// to_bf16 eight at a time, as eight 16-bit words.
__attribute__((target("avx2"))) inline __m128i bf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

__attribute__((target("avx2"))) inline void round_bf16_avx2(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bf16x8(_mm256_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, c10::BFloat16* out) { *out = to_bf16(x); }
inline void narrow(float x, c10::Half* out) { *out = c10::Half(x); }

inline bool has_avx512() {
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return avx512;
}

inline bool has_avx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return avx2;
}

}  // namespace logdiff
