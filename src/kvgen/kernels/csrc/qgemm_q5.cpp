// Q5 (GGUF Q5_1 repacked into 8-row groups, see common.h), Q5_0 (its record without m: m = -16 d, computed) and
// Q5_K (super-block records: byte scales and mins under fp16 d, dmin) times Q8A activations: w = u * d + m with u the
// 5-bit value (Q5_K: d = d sc, m = -dmin m per 32 columns, ggml dequantize_row_q5_K's values). Per 32-column block
// and group: 4 loads of low nibbles as the Q4 kernel, and one load of high bits whose byte (r, i) holds bit t for
// column 4t+i and bit 4+t for column 16+4t+i, each shifted to bit 4 and OR'd in: 8 vectors of u (4 columns x 8 rows).
// maddubs against 4 broadcast activation bytes, four summed in int16 (4 * 2 * 31 * 127 = 31,496 < 32,767), madd to
// int32, then acc += dot * d_w * d_a + m_w * s_a (llama.cpp ggml_vec_dot_q5_1_q8_1 algebra). The arithmetic of a row
// does not depend on how many rows share the call.
#include <immintrin.h>

#include <cstring>

#include "common.h"

#ifndef KVGEN_Q5_PREFETCH
#define KVGEN_Q5_PREFETCH 28
#endif
#ifndef KVGEN_Q5K_PREFETCH
#define KVGEN_Q5K_PREFETCH 4
#endif

namespace kvgen {
namespace {

// bit k of each byte of v moved to bit 4 (other bits cleared); k in 0..7 known at compile time after unrolling
template <int K>
inline __m256i bit_to_4(__m256i v, __m256i bit4) {
  if constexpr (K < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - K), bit4);
  else if constexpr (K == 4) return _mm256_and_si256(v, bit4);
  else return _mm256_and_si256(_mm256_srli_epi16(v, K - 4), bit4);
}

template <int T>
inline void unpack(const uint8_t* qs, __m256i qh, __m256i low4, __m256i bit4, __m256i& lo, __m256i& hi) {
  const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * T));
  lo = _mm256_or_si256(_mm256_and_si256(p, low4), bit_to_4<T>(qh, bit4));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), low4), bit_to_4<4 + T>(qh, bit4));
}

// The 5-bit values of nibbles qs[4][8][4] and the high bits qh[8][4] after them at qs + 128 (every Q5 layout's,
// common.h): lo[t] = columns 4t+i, hi[t] = columns 16+4t+i of the 8 rows (nibble | fifth bit).
inline void unpack_record(const uint8_t* qs, __m256i* lo, __m256i* hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 128));
  unpack<0>(qs, qh, low4, bit4, lo[0], hi[0]);
  unpack<1>(qs, qh, low4, bit4, lo[1], hi[1]);
  unpack<2>(qs, qh, low4, bit4, lo[2], hi[2]);
  unpack<3>(qs, qh, low4, bit4, lo[3], hi[3]);
}

// dot[m]: int32 per row of the 8 rows' 5-bit values (nibbles at qs, high bits at qs + 128) times activation block b
// of row m.
template <int MT>
inline void q5_dots(const uint8_t* qs, const BlockQ8A* const* a, int64_t b, __m256i* dot) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo[4], hi[4];  // columns 4t+i and 16+4t+i, 8 rows
  unpack_record(qs, lo, hi);
  for (int m = 0; m < MT; ++m) {
    const int8_t* q = a[m][b].qs;
    dot[m] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int t = 0; t < 4; t += 2) {
      __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo[t], bcast4(q + 4 * t)),
                                   _mm256_maddubs_epi16(hi[t], bcast4(q + 16 + 4 * t)));
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[t + 1], bcast4(q + 4 * t + 4)));
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[t + 1], bcast4(q + 20 + 4 * t)));
      dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(s, ones));
      if constexpr (MT > 1) keep_in_register(dot[m]);  // one row: the tree GCC builds fits the registers
    }
  }
}

KVGEN_VNNI_BEGIN
// q5_dots with vpdpbusd (common.h): a row's 8 vectors over two running sums (one chain waited on their latency).
template <int MT>
inline void q5_dots_vnni(const uint8_t* qs, const BlockQ8A* const* a, int64_t b, __m256i* dot) {
  __m256i lo[4], hi[4];  // columns 4t+i and 16+4t+i, 8 rows
  unpack_record(qs, lo, hi);
  for (int m = 0; m < MT; ++m) {
    const int8_t* q = a[m][b].qs;
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) {
      s0 = _mm256_dpbusd_epi32(s0, lo[t], bcast4(q + 4 * t));
      s1 = _mm256_dpbusd_epi32(s1, hi[t], bcast4(q + 16 + 4 * t));
    }
    dot[m] = _mm256_add_epi32(s0, s1);
  }
}
KVGEN_VNNI_END

// MT activation rows against one group's nb Q5 (HasMin) or Q5_0 records (affine_tile in common.h): dots(qs, b, dot)
// gives each row's int32 dot for activation block b from the nibbles at qs and the high bits at qs + 128.
template <int MT, bool HasMin, class Dots>
__attribute__((always_inline)) inline void q5_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                   float* const* out, Dots dots) {
  // dots passes straight through: a lambda of this (AVX2) function in between kept a VNNI tile's dots out of line
  constexpr int64_t kRecord = HasMin ? kQ5Record : kQ50Record, kDotsAt = HasMin ? 32 : 16;
  affine_tile<MT, kRecord, KVGEN_Q5_PREFETCH, HasMin ? 0 : 16, kDotsAt>(w, a, nb, out, dots);
}

// Q5_K: block k's nibbles at 128 + 160k and high bits at 256 + 160k of a super-block record (k_quant_tile in
// common.h).
template <int MT>
void q5k_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out, const uint8_t* scales) {
  k_quant_tile<MT, kQ5KRecord, KVGEN_Q5K_PREFETCH>(
      w, a, nb, out, scales, [a](const uint8_t* r, int k, int64_t b, __m256i* dot) {
        q5_dots<MT>(r + 128 + 160 * k, a, b, dot);
      });
}

KVGEN_VNNI_BEGIN
template <int MT, bool HasMin>
void q5_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out) {
  q5_tile<MT, HasMin>(w, a, nb, out, [a](const uint8_t* qs, int64_t b, __m256i* dot) {
    q5_dots_vnni<MT>(qs, a, b, dot);
  });
}

template <int MT>
void q5k_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out, const uint8_t* scales) {
  k_quant_tile<MT, kQ5KRecord, KVGEN_Q5K_PREFETCH>(
      w, a, nb, out, scales,
      [a](const uint8_t* r, int k, int64_t b, __m256i* dot) {
        q5_dots_vnni<MT>(r + 128 + 160 * k, a, b, dot);
      });
}
KVGEN_VNNI_END

KVGEN_VNNI_BEGIN
// bit_to_4 of 512-bit registers.
template <int K>
inline __m512i bit_to_4_pair(__m512i v, __m512i bit4) {
  if constexpr (K < 4) return _mm512_and_si512(_mm512_slli_epi16(v, 4 - K), bit4);
  else if constexpr (K == 4) return _mm512_and_si512(v, bit4);
  else return _mm512_and_si512(_mm512_srli_epi16(v, K - 4), bit4);
}

template <int T>
inline void unpack_pair(const uint8_t* qs0, const uint8_t* qs1, __m512i qh, __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  const __m512i p = pair_bytes(qs0 + 32 * T, qs1 + 32 * T);
  lo = _mm512_or_si512(_mm512_and_si512(p, low4), bit_to_4_pair<T>(qh, bit4));
  hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p, 4), low4), bit_to_4_pair<4 + T>(qh, bit4));
}

// q5_dots_vnni of two groups' records (the pair tiles, common.h) for kVnniRows activation rows.
inline void pair_q5_dots(const uint8_t* qs0, const uint8_t* qs1, const BlockQ8A* const* a, int64_t b, __m512i* dot) {
  const __m512i qh = pair_bytes(qs0 + 128, qs1 + 128);
  __m512i lo[4], hi[4];  // columns 4t+i and 16+4t+i, 16 rows
  unpack_pair<0>(qs0, qs1, qh, lo[0], hi[0]);
  unpack_pair<1>(qs0, qs1, qh, lo[1], hi[1]);
  unpack_pair<2>(qs0, qs1, qh, lo[2], hi[2]);
  unpack_pair<3>(qs0, qs1, qh, lo[3], hi[3]);
  for (int m = 0; m < kVnniRows; ++m) {
    const int8_t* q = a[m][b].qs;
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      s0 = _mm512_dpbusd_epi32(s0, lo[t], bcast4x16(q + 4 * t));
      s1 = _mm512_dpbusd_epi32(s1, hi[t], bcast4x16(q + 16 + 4 * t));
    }
    dot[m] = _mm512_add_epi32(s0, s1);
  }
}
KVGEN_VNNI_END

template <bool HasMin>
void group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  if (use_vnni()) return vnni_tile_rows(mt, [&](auto MT, int r) { q5_tile_vnni<MT, HasMin>(w, a + r, nb, out + r); });
  tile_rows(mt, [&](auto MT) {
    q5_tile<MT, HasMin>(w, a, nb, out, [a](const uint8_t* qs, int64_t b, __m256i* dot) {
      q5_dots<decltype(MT)::value>(qs, a, b, dot);
    });
  });
}

}  // namespace

void q5_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  group<true>(w, a, mt, nb, out);
}

void q50_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  group<false>(w, a, mt, nb, out);
}

void q5k_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out,
               const uint8_t* scales) {
  if (use_vnni()) return vnni_tile_rows(mt, [&](auto MT, int r) { q5k_tile_vnni<MT>(w, a + r, nb, out + r, scales); });
  tile_rows(mt, [&](auto MT) { q5k_tile<MT>(w, a, nb, out, scales); });
}

KVGEN_VNNI_BEGIN
void q5_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, int64_t nb, float* const* out,
                  bool has_min) {
  const auto dots = [a](const uint8_t* qs0, const uint8_t* qs1, int64_t b, __m512i* dot) {
    pair_q5_dots(qs0, qs1, a, b, dot);
  };
  if (has_min) return affine_pair_tile<kQ5Record, KVGEN_Q5_PREFETCH, 0, 32>(w0, w1, a, nb, out, dots);
  affine_pair_tile<kQ50Record, KVGEN_Q5_PREFETCH, 16, 16>(w0, w1, a, nb, out, dots);
}

void q5k_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, int64_t nb, float* const* out,
                   const uint8_t* scales0, const uint8_t* scales1) {
  k_quant_pair_tile<kQ5KRecord, KVGEN_Q5K_PREFETCH>(
      w0, w1, a, nb, out, scales0, scales1, [a](const uint8_t* r0, const uint8_t* r1, int k, int64_t b, __m512i* dot) {
        pair_q5_dots(r0 + 128 + 160 * k, r1 + 128 + 160 * k, a, b, dot);
      });
}
KVGEN_VNNI_END

}  // namespace kvgen
