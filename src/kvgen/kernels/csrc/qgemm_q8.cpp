// Q8 (GGUF Q8_0 repacked into 8-row groups, see common.h) times Q8A activations.
// Per 32-column block and group: 8 loads of 32 bytes (4 columns x 8 rows each);
// maddubs(|w|, sign(a, w)) (llama.cpp's mul_sum_i8_pairs trick: maddubs needs one
// unsigned operand), madd to int32 per load (two int16 products could overflow), then
// acc += dot * d_w * d_a (with AVX512-VNNI, common.h: vpdpbusd(|w|, sign(a, w)) for the maddubs and madd). The
// arithmetic of a row does not depend on the batch.
#include <immintrin.h>

#include <cstring>

#include "common.h"

#ifndef KVGEN_Q8_PREFETCH
#define KVGEN_Q8_PREFETCH 16
#endif

namespace kvgen {
namespace {

// MT activation rows against one group's nb Q8 records: dots(w, b, sum) gives each row's int32 dot with the record
// at w for activation block b, then acc += dot * d_w * d_a. Always inlined, so a VNNI tile gets the loop in its own
// body with its dots inlined (common.h).
template <int MT, class Dots>
__attribute__((always_inline)) inline void q8_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                   float* const* out, Dots dots) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kQ8Record) {
    for (int c = 0; c < kQ8Record; c += 64) {  // ~4 KB ahead, as the Q4 kernel
      _mm_prefetch(reinterpret_cast<const char*>(w) + KVGEN_Q8_PREFETCH * kQ8Record + c, _MM_HINT_T0);
    }
    __m256i sum[MT];
    dots(w, b, sum);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), _mm256_mul_ps(dw, _mm256_set1_ps(a[m][b].d)), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

template <int MT>
inline void q8_dots(const uint8_t* w, const BlockQ8A* const* a, int64_t b, __m256i* sum) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 + 32 * j));
    const __m256i aq = _mm256_sign_epi8(q, q);
    for (int m = 0; m < MT; ++m) {
      const __m256i s = _mm256_sign_epi8(bcast4(a[m][b].qs + 4 * j), q);
      sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, s), ones));
      if constexpr (MT > 1) keep_in_register(sum[m]);  // one row: the tree GCC builds fits the registers
    }
  }
}

KVGEN_VNNI_BEGIN
// q8_dots with vpdpbusd(|w|, sign(a, w)): the 4 products of each lane summed straight into int32 (common.h), a row's
// 8 loads over kChains running sums (one chain of 8 dependent vpdpbusd waited on their latency).
template <int MT>
inline void q8_dots_vnni(const uint8_t* w, const BlockQ8A* const* a, int64_t b, __m256i* sum) {
  constexpr int kChains = MT == 1 ? 4 : 2;
  __m256i part[MT][kChains];
  for (int m = 0; m < MT; ++m)
    for (int c = 0; c < kChains; ++c) part[m][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 + 32 * j));
    const __m256i aq = _mm256_sign_epi8(q, q);
    for (int m = 0; m < MT; ++m) {
      const __m256i s = _mm256_sign_epi8(bcast4(a[m][b].qs + 4 * j), q);
      part[m][j % kChains] = _mm256_dpbusd_epi32(part[m][j % kChains], aq, s);
    }
  }
  for (int m = 0; m < MT; ++m) {
    sum[m] = _mm256_add_epi32(part[m][0], part[m][1]);
    if constexpr (kChains == 4) sum[m] = _mm256_add_epi32(sum[m], _mm256_add_epi32(part[m][2], part[m][3]));
  }
}

template <int MT>
void q8_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out) {
  q8_tile<MT>(w, a, nb, out, [a](const uint8_t* r, int64_t b, __m256i* sum) { q8_dots_vnni<MT>(r, a, b, sum); });
}
KVGEN_VNNI_END

}  // namespace

void q8_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  if (use_vnni()) return tile_rows(mt, [&](auto MT) { q8_tile_vnni<MT>(w, a, nb, out); });
  tile_rows(mt, [&](auto MT) {
    q8_tile<MT>(w, a, nb, out, [a](const uint8_t* r, int64_t b, __m256i* sum) {
      q8_dots<decltype(MT)::value>(r, a, b, sum);
    });
  });
}

}  // namespace kvgen
