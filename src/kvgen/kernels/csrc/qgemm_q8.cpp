// Q8 (GGUF Q8_0 repacked into 8-row groups, see common.h) times Q8A activations.
// Per 32-column block and group: 8 loads of 32 bytes (4 columns x 8 rows each);
// maddubs(|w|, sign(a, w)) (llama.cpp's mul_sum_i8_pairs trick: maddubs needs one
// unsigned operand), madd to int32 per load (two int16 products could overflow), then
// acc += dot * d_w * d_a (with AVX512-VNNI, common.h: vpdpbusd(|w|, sign(a, w)) for the maddubs and madd; 8 rows at
// once: vpdpbusd(a + 128, w) - 128 sum(w), see q8_dots_vnni_offset). The arithmetic of a row does not depend on the
// batch: every path gives the same int32 dots.
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

// The 8-row tile's dots: vpdpbusd takes the activation bytes offset by 128 (au[m]: a + 128 as uint8, its unsigned
// operand, from activation_offset_bytes) against the weights as they are (signed), so it sums dot + 128 sum(w), and
// 128 sum(w) of each row comes from one more vpdpbusd per load (128 against the weights) that the 8 rows share:
// 8 + 64 vpdpbusd a record where the sign form takes 64 and 72 vpsignb. Exact in int32 (|sums| < 32 * 255 * 128), so
// the dots equal the other tiles'. Measured (qgemm, 2 threads, in-process A/B against four-row sign tiles): 1.13-1.37x
// at M = 8-256 on 3072 x 576, 576 x 1536 and the 49152 x 576 LM head. With fewer rows the bias vpdpbusd costs more
// than the signs saved (576 x 1536 at M = 1: 0.9x), so those keep the sign form.
inline void q8_dots_vnni_offset(const uint8_t* w, const uint8_t* const* au, int64_t b, __m256i* sum) {
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i bias[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int m = 0; m < 8; ++m) sum[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 + 32 * j));
    bias[j % 2] = _mm256_dpbusd_epi32(bias[j % 2], offset, q);  // 128 sum(w) over the 4 columns, per row
    for (int m = 0; m < 8; ++m) {
      sum[m] = _mm256_dpbusd_epi32(sum[m], bcast4(reinterpret_cast<const int8_t*>(au[m] + kBlock * b + 4 * j)), q);
    }
  }
  const __m256i total_bias = _mm256_add_epi32(bias[0], bias[1]);
  for (int m = 0; m < 8; ++m) sum[m] = _mm256_sub_epi32(sum[m], total_bias);
}

void q8_tile_vnni_8(const uint8_t* w, const BlockQ8A* const* a, const uint8_t* const* au, int64_t nb,
                    float* const* out) {
  q8_tile<8>(w, a, nb, out, [au](const uint8_t* r, int64_t b, __m256i* sum) { q8_dots_vnni_offset(r, au, b, sum); });
}
KVGEN_VNNI_END

}  // namespace

void activation_offset_bytes(const BlockQ8A* a, int64_t n, uint8_t* au) {
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < n; ++b, au += kBlock) {  // x ^ 0x80 = x + 128 for an int8 x read as uint8
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[b].qs));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(au), _mm256_xor_si256(q, offset));
  }
}

void q8_group(const uint8_t* w, const BlockQ8A* const* a, const uint8_t* const* au, int mt, int64_t nb,
              float* const* out) {
  if (use_vnni()) {  // 8 rows with offset bytes in one tile, the others in sign tiles
    return vnni_tile_rows(mt, [&](auto MT, int r) {
      if constexpr (MT == 8) return q8_tile_vnni_8(w, a, au, nb, out);
      else q8_tile_vnni<MT>(w, a + r, nb, out + r);
    });
  }
  tile_rows(mt, [&](auto MT) {
    q8_tile<MT>(w, a, nb, out, [a](const uint8_t* r, int64_t b, __m256i* sum) {
      q8_dots<decltype(MT)::value>(r, a, b, sum);
    });
  });
}

}  // namespace kvgen
