// Q8 (GGUF Q8_0 repacked into 8-row groups, the values stored plus 128 as uint8, see common.h) times Q8A activations.
// Per 32-column block and group: 8 loads of 32 bytes (4 columns x 8 rows each). AVX2: the stored bytes xor 0x80 give
// the int8 values back (one xor a load, shared by the rows), then maddubs(|w|, sign(a, w)) (llama.cpp's
// mul_sum_i8_pairs trick: maddubs needs one unsigned operand), madd to int32 per load (two int16 products could
// overflow). AVX512-VNNI: vpdpbusd of the stored bytes (w + 128, its unsigned operand) against the activations as
// they are, minus 128 x the activation block's sum (made once a call): no vpsignb, where vpdpbusd(|w|, sign(a, w))
// took two a product. Then acc += dot * d_w * d_a. Every path gives the same int32 dots, so the arithmetic of a row
// does not depend on the batch or the ISA.
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
  const __m256i ones = _mm256_set1_epi16(1), offset = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 + 32 * j)), offset);
    const __m256i aq = _mm256_sign_epi8(q, q);
    for (int m = 0; m < MT; ++m) {
      const __m256i s = _mm256_sign_epi8(bcast4(a[m][b].qs + 4 * j), q);
      sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, s), ones));
      if constexpr (MT > 1) keep_in_register(sum[m]);  // one row: the tree GCC builds fits the registers
    }
  }
}

KVGEN_VNNI_BEGIN
// The VNNI dots: vpdpbusd(w + 128, a) into kChains running sums a row (one chain of 8 dependent vpdpbusd waited on
// their latency; at MT = 8 the rows' own chains are enough), minus block_sums[m][b] = 128 sum(a). Exact in int32
// (|sum((w + 128) a)| < 32 * 255 * 127).
template <int MT>
inline void q8_dots_vnni(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* block_sums, int64_t b,
                         __m256i* sum) {
  constexpr int kChains = MT == 1 ? 4 : MT <= 4 ? 2 : 1;
  __m256i part[MT][kChains];
  for (int m = 0; m < MT; ++m)
    for (int c = 0; c < kChains; ++c) part[m][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 + 32 * j));
    for (int m = 0; m < MT; ++m) {
      part[m][j % kChains] = _mm256_dpbusd_epi32(part[m][j % kChains], u, bcast4(a[m][b].qs + 4 * j));
    }
  }
  for (int m = 0; m < MT; ++m) {
    sum[m] = part[m][0];
    for (int c = 1; c < kChains; ++c) sum[m] = _mm256_add_epi32(sum[m], part[m][c]);
    sum[m] = _mm256_sub_epi32(sum[m], _mm256_set1_epi32(block_sums[m][b]));
  }
}

template <int MT>
void q8_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* block_sums, int64_t nb,
                  float* const* out) {
  q8_tile<MT>(w, a, nb, out, [a, block_sums](const uint8_t* r, int64_t b, __m256i* sum) {
    q8_dots_vnni<MT>(r, a, block_sums, b, sum);
  });
}
KVGEN_VNNI_END

}  // namespace

void q8_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* block_sums, int mt, int64_t nb,
              float* const* out) {
  if (block_sums != nullptr) {
    return vnni_tile_rows(mt, [&](auto MT, int r) { q8_tile_vnni<MT>(w, a + r, block_sums + r, nb, out + r); });
  }
  tile_rows(mt, [&](auto MT) {
    q8_tile<MT>(w, a, nb, out, [a](const uint8_t* r, int64_t b, __m256i* sum) {
      q8_dots<decltype(MT)::value>(r, a, b, sum);
    });
  });
}

KVGEN_VNNI_BEGIN
// The pair tile (common.h): lane by lane the operations of q8_tile_vnni<8>.
void q8_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* block_sums,
                  int64_t nb, float* const* out) {
  __m512 acc[kVnniRows];
  for (int m = 0; m < kVnniRows; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w0 += kQ8Record, w1 += kQ8Record) {
    prefetch_pair(w0, w1, KVGEN_Q8_PREFETCH * kQ8Record, kQ8Record);
    __m512i dot[kVnniRows];
    for (int m = 0; m < kVnniRows; ++m) dot[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i u = pair_bytes(w0 + 16 + 32 * j, w1 + 16 + 32 * j);
      for (int m = 0; m < kVnniRows; ++m) dot[m] = _mm512_dpbusd_epi32(dot[m], u, bcast4x16(a[m][b].qs + 4 * j));
    }
    const __m512 dw = pair_halves(w0, w1);
    for (int m = 0; m < kVnniRows; ++m) {
      const __m512i sum = _mm512_sub_epi32(dot[m], _mm512_set1_epi32(block_sums[m][b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(a[m][b].d)), acc[m]);
    }
  }
  for (int m = 0; m < kVnniRows; ++m) _mm512_storeu_ps(out[m], acc[m]);
}
KVGEN_VNNI_END

}  // namespace kvgen
