// Q4 (GGUF Q4_1 repacked into 8-row groups, see common.h), Q4_0 (its record without m: m = -8 d, computed) and Q4_K
// (super-block records: byte scales and mins under fp16 d, dmin) times Q8A activations.
// Per 32-column block and group: 4 loads of 32 bytes give 8 vectors of 4 columns x 8 rows
// (low and high nibbles); maddubs against 4 broadcast activation bytes, int16 sums over
// the 8 vectors (8 * 2 * 15 * 127 = 30,480 < 32,767, exact), one madd to int32 per row, then
//   Q4, Q4_0: acc += dot * d_w * d_a + m_w * s_a (llama.cpp ggml_vec_dot_q4_1_q8_1 algebra);
//   Q4_K: the same with d_w = d sc and m_w = -dmin m of the block (ggml dequantize_row_q4_K's values), in fp32.
// With AVX512-VNNI (common.h) vpdpbusd gives the same int32 dots in one instruction per vector and row.
// The arithmetic of a row does not depend on how many rows share the call.
#include <immintrin.h>

#include <cstring>

#include "common.h"

#ifndef KVGEN_Q4_PREFETCH
#define KVGEN_Q4_PREFETCH 32
#endif
#ifndef KVGEN_Q4K_PREFETCH
#define KVGEN_Q4K_PREFETCH 4
#endif

namespace kvgen {
namespace {

constexpr int64_t kPrefetchRecords = KVGEN_Q4_PREFETCH;  // ~5 KB ahead

// sum[m]: int16 pair sums of the 8 rows' nibbles qs[4][8][4] (128 bytes, the Q4 record's layout) times activation
// block b of row m.
template <int MT>
inline void nibble_sums(const uint8_t* qs, const BlockQ8A* const* a, int64_t b, __m256i* sum) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
  for (int t = 0; t < 4; ++t) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * t));
    const __m256i lo = _mm256_and_si256(p, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
    for (int m = 0; m < MT; ++m) {
      const int8_t* q = a[m][b].qs;
      sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(lo, bcast4(q + 4 * t)));
      sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(hi, bcast4(q + 16 + 4 * t)));
      if constexpr (MT > 1) keep_in_register(sum[m]);  // one row: the tree GCC builds fits the registers
    }
  }
}

// MT activation rows against one group's nb Q4 (HasMin) or Q4_0 records (affine_tile in common.h): dots(qs, b, dot)
// gives dot[m], row m's int32 dot with the nibbles at qs for activation block b. One group a call at every M: a
// two-group tile (each activation broadcast serving 16 rows) ran 3072 x 768 faster with the weights in cache, but
// decode steps of 2 / 4 sequences, weights from DRAM, 1.3 / 1.1x slower than this one.
template <int MT, bool HasMin, class Dots>
__attribute__((always_inline)) inline void q4_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                   float* const* out, Dots dots) {
  // dots passes straight through: a lambda of this (AVX2) function in between kept a VNNI tile's dots out of line
  constexpr int64_t kRecord = HasMin ? kQ4Record : kQ40Record, kDotsAt = HasMin ? 32 : 16;
  affine_tile<MT, kRecord, kPrefetchRecords, HasMin ? 0 : 8, kDotsAt>(w, a, nb, out, dots);
}

// The int32 dots of the nibbles at qs with activation block b: nibble_sums, then one madd per row.
template <int MT>
inline void nibble_dots(const uint8_t* qs, const BlockQ8A* const* a, int64_t b, __m256i* dot) {
  __m256i sum[MT];
  nibble_sums<MT>(qs, a, b, sum);
  for (int m = 0; m < MT; ++m) dot[m] = _mm256_madd_epi16(sum[m], _mm256_set1_epi16(1));
}

KVGEN_VNNI_BEGIN
// nibble_dots with vpdpbusd: each nibble vector's products with 4 broadcast activation bytes summed straight into the
// int32 lanes (common.h). A row's 8 products per block go to kChains running sums, added at the end (exact): one
// chain of 8 dependent vpdpbusd per row kept the tile waiting on their latency. At MT = 8 the rows' own chains are
// enough, and two per row would not fit the 32 registers.
template <int MT>
inline void nibble_dots_vnni(const uint8_t* qs, const BlockQ8A* const* a, int64_t b, __m256i* dot) {
  constexpr int kChains = MT == 1 ? 4 : MT <= 4 ? 2 : 1;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i part[MT][kChains];
  for (int m = 0; m < MT; ++m)
    for (int c = 0; c < kChains; ++c) part[m][c] = _mm256_setzero_si256();
  for (int t = 0; t < 4; ++t) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * t));
    const __m256i lo = _mm256_and_si256(p, low4), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
    const int c = (2 * t) % kChains, c1 = (c + 1) % kChains;  // t's low nibbles to chain c, high ones to c1
    for (int m = 0; m < MT; ++m) {
      part[m][c] = _mm256_dpbusd_epi32(part[m][c], lo, bcast4(a[m][b].qs + 4 * t));
      part[m][c1] = _mm256_dpbusd_epi32(part[m][c1], hi, bcast4(a[m][b].qs + 16 + 4 * t));
    }
  }
  for (int m = 0; m < MT; ++m) {
    dot[m] = part[m][0];
    for (int c = 1; c < kChains; ++c) dot[m] = _mm256_add_epi32(dot[m], part[m][c]);
  }
}

template <int MT, bool HasMin>
void q4_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out) {
  q4_tile<MT, HasMin>(w, a, nb, out, [a](const uint8_t* qs, int64_t b, __m256i* dot) {
    nibble_dots_vnni<MT>(qs, a, b, dot);
  });
}

template <int MT>
void q4k_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out, const uint8_t* scales) {
  k_quant_tile<MT, kQ4KRecord, KVGEN_Q4K_PREFETCH>(w, a, nb, out, scales, [a](const uint8_t* r, int k, int64_t b,
                                                                              __m256i* dot) {
    nibble_dots_vnni<MT>(r + 128 + 128 * k, a, b, dot);
  });
}

// nibble_dots_vnni of two groups' nibbles (qs0, qs1: the Q4 record's layout) for kVnniRows activation rows: each
// broadcast of 4 activation bytes serves 16 weight rows. Exact int32 sums, as nibble_dots_vnni's.
inline void pair_nibble_dots(const uint8_t* qs0, const uint8_t* qs1, const BlockQ8A* const* a, int64_t b,
                             __m512i* dot) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int m = 0; m < kVnniRows; ++m) dot[m] = _mm512_setzero_si512();
  for (int t = 0; t < 4; ++t) {
    const __m512i p = pair_bytes(qs0 + 32 * t, qs1 + 32 * t);
    const __m512i lo = _mm512_and_si512(p, low4), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
    for (int m = 0; m < kVnniRows; ++m) {
      dot[m] = _mm512_dpbusd_epi32(dot[m], lo, bcast4x16(a[m][b].qs + 4 * t));
      dot[m] = _mm512_dpbusd_epi32(dot[m], hi, bcast4x16(a[m][b].qs + 16 + 4 * t));
    }
  }
}

KVGEN_VNNI_END

// Q4_K: block k's nibbles at 128 + 128k of a super-block record (k_quant_tile in common.h).
template <int MT>
void q4k_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out, const uint8_t* scales) {
  k_quant_tile<MT, kQ4KRecord, KVGEN_Q4K_PREFETCH>(w, a, nb, out, scales, [a](const uint8_t* r, int k, int64_t b,
                                                                              __m256i* dot) {
    nibble_dots<MT>(r + 128 + 128 * k, a, b, dot);
  });
}

template <bool HasMin>
void group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  if (use_vnni()) return vnni_tile_rows(mt, [&](auto MT, int r) { q4_tile_vnni<MT, HasMin>(w, a + r, nb, out + r); });
  tile_rows(mt, [&](auto MT) {
    q4_tile<MT, HasMin>(w, a, nb, out, [a](const uint8_t* qs, int64_t b, __m256i* dot) {
      nibble_dots<decltype(MT)::value>(qs, a, b, dot);
    });
  });
}

}  // namespace

void q4k_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out,
               const uint8_t* scales) {
  if (use_vnni()) return vnni_tile_rows(mt, [&](auto MT, int r) { q4k_tile_vnni<MT>(w, a + r, nb, out + r, scales); });
  tile_rows(mt, [&](auto MT) { q4k_tile<MT>(w, a, nb, out, scales); });
}

void q4_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  group<true>(w, a, mt, nb, out);
}

void q40_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  group<false>(w, a, mt, nb, out);
}

KVGEN_VNNI_BEGIN
void q4_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, int64_t nb, float* const* out,
                  bool has_min) {
  const auto dots = [a](const uint8_t* qs0, const uint8_t* qs1, int64_t b, __m512i* dot) {
    pair_nibble_dots(qs0, qs1, a, b, dot);
  };
  if (has_min) return affine_pair_tile<kQ4Record, kPrefetchRecords, 0, 32>(w0, w1, a, nb, out, dots);
  affine_pair_tile<kQ40Record, kPrefetchRecords, 8, 16>(w0, w1, a, nb, out, dots);
}

void q4k_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, int64_t nb, float* const* out,
                   const uint8_t* scales0, const uint8_t* scales1) {
  k_quant_pair_tile<kQ4KRecord, KVGEN_Q4K_PREFETCH>(
      w0, w1, a, nb, out, scales0, scales1, [a](const uint8_t* r0, const uint8_t* r1, int k, int64_t b, __m512i* dot) {
        pair_nibble_dots(r0 + 128 + 128 * k, r1 + 128 + 128 * k, a, b, dot);
      });
}
KVGEN_VNNI_END

}  // namespace kvgen
