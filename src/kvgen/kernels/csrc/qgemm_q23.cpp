// Q2 and Q3 (GGUF Q2_K / Q3_K repacked into 8-row groups, one record per 256-column super-block, see common.h)
// times Q8A activations: the file's own 2- and 3-bit values. Per 32-column block k of a super-block: two loads of
// 2-bit planes (one per 16-column half h; shift 2s of byte 4r+i = column 16h + 4s + i of row r), plus for Q3 one
// load of high bits (bit 4h + s), give 8 vectors of u (4 columns x 8 rows); maddubs(u, a) summed in int16 per half
// (4 * 2 * 7 * 127 = 7,112), then madd with the half's scale: dot = sum_h sc_h * sum u a, int32 per row.
//   Q2: w = d * sc * u - dmin * m (sc, m 4-bit per 16 columns): acc += dot * d d_a - (sum_h m_h A_h) * dmin d_a.
//   Q3: w = d * sc * (u - 4) (sc = s - 32, int8 per 16 columns):   acc += (dot - 4 sum_h sc_h A_h) * d d_a.
// A_h: the activation block's half sums (activation_half_sums, once per call). With AVX512-VNNI (q23_tile_vnni)
// vpdpbusd sums each half in int32, then times sc_h with vpmulld: the same integers. The arithmetic of a row does not
// depend on how many rows share the call or on the ISA. Source of the values: ggml dequantize_row_q2_K /
// dequantize_row_q3_K.
#include <immintrin.h>

#include <cstring>

#include "common.h"

#ifndef KVGEN_Q23_PREFETCH
#define KVGEN_Q23_PREFETCH 4
#endif

namespace kvgen {
namespace {

// The 8 rows' values of one 16-column half (4 vectors of 4 columns x 8 rows) times the activations, summed in int16.
inline __m256i half_dot(const __m256i* u, const int8_t* q) {
  return _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u[0], bcast4(q)), _mm256_maddubs_epi16(u[1], bcast4(q + 4))),
                          _mm256_add_epi16(_mm256_maddubs_epi16(u[2], bcast4(q + 8)), _mm256_maddubs_epi16(u[3], bcast4(q + 12))));
}

// x (8 int32 lanes, values within int16) in both int16 halves of each lane: the madd partner of pair sums.
inline __m256i twice(__m256i x) {
  return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(x, 16));
}

// (x0, x1) as the low and high int16 of each lane: the madd partner of an activation block's half sums.
inline __m256i pair(__m256i x0, __m256i x1) {
  return _mm256_or_si256(_mm256_and_si256(x0, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(x1, 16));
}

// Block k of a Q2 / Q3 record w: u[h][s] (columns 16h + 4s + i of the 8 rows, in [0, 3] / [0, 7]), each row's
// scales sc0, sc1 of the two halves (int32 lanes), and corr_pair: the madd partner of an activation block's half sums
// (Q2: the halves' mins, Q3: their scales).
template <bool Q3>
__attribute__((always_inline)) inline void q23_block(const uint8_t* w, int k, __m256i (&u)[2][4], __m256i& sc0,
                                                     __m256i& sc1, __m256i& corr_pair) {
  constexpr int64_t kBits = Q3 ? 144 : 160;  // offset of the planes
  const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
  for (int h = 0; h < 2; ++h) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBits + 64 * k + 32 * h));
    u[h][0] = _mm256_and_si256(p, three);
    u[h][1] = _mm256_and_si256(_mm256_srli_epi16(p, 2), three);
    u[h][2] = _mm256_and_si256(_mm256_srli_epi16(p, 4), three);
    u[h][3] = _mm256_and_si256(_mm256_srli_epi16(p, 6), three);
  }
  if constexpr (Q3) {
    const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBits + 512 + 32 * k));
    // bit t = 4h + s of each byte to bit 2 (16-bit shifts: the bits that cross bytes are masked off)
    u[0][0] = _mm256_or_si256(u[0][0], _mm256_and_si256(_mm256_slli_epi16(hv, 2), four));
    u[0][1] = _mm256_or_si256(u[0][1], _mm256_and_si256(_mm256_slli_epi16(hv, 1), four));
    u[0][2] = _mm256_or_si256(u[0][2], _mm256_and_si256(hv, four));
    u[0][3] = _mm256_or_si256(u[0][3], _mm256_and_si256(_mm256_srli_epi16(hv, 1), four));
    for (int s = 0; s < 4; ++s) {
      u[1][s] = _mm256_or_si256(u[1][s], _mm256_and_si256(_mm256_srli_epi16(hv, 2 + s), four));
    }
    sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 16 + 16 * k)));
    sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 24 + 16 * k)));
    corr_pair = pair(sc0, sc1);
  } else {
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 32 + 16 * k));  // [h][r]: sc | m << 4
    const __m128i lo = _mm_and_si128(s, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(15));
    sc0 = _mm256_cvtepu8_epi32(lo);
    sc1 = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    corr_pair = pair(_mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

// MT activation rows against one group's Q2 / Q3 records: per block b (k of its record), rows(u, sc0, sc1, corr_pair,
// b, dw, mw, acc) adds the block's products to every row's acc. Always inlined, so a VNNI tile gets the loop in its
// own body with its rows inlined (common.h).
template <bool Q3, int MT, class Rows>
__attribute__((always_inline)) inline void q23_tile(const uint8_t* w, int64_t nb, float* const* out, Rows rows) {
  constexpr int64_t kRec = Q3 ? kQ3Record : kQ2Record;  // record bytes
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb, w += kRec) {
    const char* ahead = reinterpret_cast<const char*>(w) + KVGEN_Q23_PREFETCH * kRec;
    for (int c = 0; c < kRec; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256 mw = Q3 ? dw : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
    for (int k = 0; k < 8; ++k) {
      __m256i u[2][4];  // [half][shift]: columns 16h + 4s + i, 8 rows
      __m256i sc0, sc1, corr_pair;  // per row: the halves' scales, and the madd partner of the half sums
      q23_block<Q3>(w, k, u, sc0, sc1, corr_pair);
      rows(u, sc0, sc1, corr_pair, 8 * sb + k, dw, mw, acc);
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

// The AVX2 rows: maddubs pair sums in int16, madd with the halves' scales.
template <bool Q3, int MT>
void q23_tile_avx2(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_sums, int64_t nb,
                   float* const* out) {
  q23_tile<Q3, MT>(w, nb, out, [a, half_sums](const __m256i (&u)[2][4], __m256i sc0, __m256i sc1, __m256i corr_pair,
                                              int64_t b, __m256 dw, __m256 mw, __m256* acc) {
    const __m256i sc0x2 = twice(sc0), sc1x2 = twice(sc1);
    for (int m = 0; m < MT; ++m) {
      const int8_t* q = a[m][b].qs;
      __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(half_dot(u[0], q), sc0x2),
                                     _mm256_madd_epi16(half_dot(u[1], q + 16), sc1x2));
      const __m256i corr = _mm256_madd_epi16(corr_pair, _mm256_set1_epi32(half_sums[m][b]));  // sum_h x_h A_h
      const __m256 da = _mm256_set1_ps(a[m][b].d);
      if constexpr (Q3) {
        dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(corr, 2));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, da), acc[m]);
      } else {
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, da), acc[m]);
        acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_mul_ps(mw, da), acc[m]);
      }
    }
  });
}

KVGEN_VNNI_BEGIN
// The rows with vpdpbusd (common.h): each half's S_h = sum u a in int32 (16 * 7 * 127 at most), times sc_h with
// vpmulld. Q3's halves start at offsets[m][2b + h] = -4 A_h (activation_half_offsets), so the sum is
// sum_h sc_h (S_h - 4 A_h): the AVX2 tile's integer. Q2's mins go through the half sums as there.
template <bool Q3, int MT>
void q23_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_sums,
                   const int32_t* const* offsets, int64_t nb, float* const* out) {
  q23_tile<Q3, MT>(w, nb, out, [a, half_sums, offsets](const __m256i (&u)[2][4], __m256i sc0, __m256i sc1,
                                                       __m256i corr_pair, int64_t b, __m256 dw, __m256 mw,
                                                       __m256* acc) {
    for (int m = 0; m < MT; ++m) {
      const int8_t* q = a[m][b].qs;
      __m256i s0 = Q3 ? _mm256_set1_epi32(offsets[m][2 * b]) : _mm256_setzero_si256();
      __m256i s1 = Q3 ? _mm256_set1_epi32(offsets[m][2 * b + 1]) : _mm256_setzero_si256();
      for (int s = 0; s < 4; ++s) {
        s0 = _mm256_dpbusd_epi32(s0, u[0][s], bcast4(q + 4 * s));
        s1 = _mm256_dpbusd_epi32(s1, u[1][s], bcast4(q + 16 + 4 * s));
      }
      const __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1));
      const __m256 da = _mm256_set1_ps(a[m][b].d);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, da), acc[m]);
      if constexpr (!Q3) {
        const __m256i corr = _mm256_madd_epi16(corr_pair, _mm256_set1_epi32(half_sums[m][b]));  // sum_h m_h A_h
        acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_mul_ps(mw, da), acc[m]);
      }
    }
  });
}
KVGEN_VNNI_END

template <bool Q3>
void q23_dispatch(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_sums,
                  const int32_t* const* offsets, int mt, int64_t nb, float* const* out) {
  if (use_vnni()) {
    return vnni_tile_rows(mt, [&](auto MT, int r) {
      q23_tile_vnni<Q3, MT>(w, a + r, half_sums + r, Q3 ? offsets + r : nullptr, nb, out + r);
    });
  }
  tile_rows(mt, [&](auto MT) { q23_tile_avx2<Q3, MT>(w, a, half_sums, nb, out); });
}

}  // namespace

void q2_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_sums, int mt, int64_t nb,
              float* const* out) {
  q23_dispatch<false>(w, a, half_sums, nullptr, mt, nb, out);
}

void q3_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_sums,
              const int32_t* const* offsets, int mt, int64_t nb, float* const* out) {
  q23_dispatch<true>(w, a, half_sums, offsets, mt, nb, out);
}

KVGEN_VNNI_BEGIN
// The pair tile (common.h) of two Q2 / Q3 groups: lane by lane the operations of q23_tile_vnni<Q3, 8>, with q23_block's
// unpacking of both records in 512-bit registers.
template <bool Q3>
void q23_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* half_sums,
                   const int32_t* const* offsets, int64_t nb, float* const* out) {
  constexpr int64_t kRec = Q3 ? kQ3Record : kQ2Record, kBits = Q3 ? 144 : 160;
  const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4), low16 = _mm512_set1_epi32(0xFFFF);
  const auto bytes16 = [](__m128i x0, __m128i x1, bool high) {  // 8 bytes of each group's x as int32 lanes
    return _mm512_cvtepu8_epi32(high ? _mm_unpackhi_epi64(x0, x1) : _mm_unpacklo_epi64(x0, x1));
  };
  __m512 acc[kVnniRows];
  for (int m = 0; m < kVnniRows; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb, w0 += kRec, w1 += kRec) {
    prefetch_pair(w0, w1, KVGEN_Q23_PREFETCH * kRec, kRec);
    const __m512 dw = pair_halves(w0, w1);
    const __m512 mw = Q3 ? dw : pair_halves(w0 + 16, w1 + 16);
    for (int k = 0; k < 8; ++k) {
      const int64_t b = 8 * sb + k;
      __m512i u[2][4];  // [half][shift]: columns 16h + 4s + i, 16 rows
      for (int h = 0; h < 2; ++h) {
        const __m512i p = pair_bytes(w0 + kBits + 64 * k + 32 * h, w1 + kBits + 64 * k + 32 * h);
        for (int sh = 0; sh < 4; ++sh) u[h][sh] = _mm512_and_si512(_mm512_srli_epi16(p, 2 * sh), three);
      }
      __m512i sc0, sc1, corr_pair;
      if constexpr (Q3) {
        const __m512i hv = pair_bytes(w0 + kBits + 512 + 32 * k, w1 + kBits + 512 + 32 * k);
        u[0][0] = _mm512_or_si512(u[0][0], _mm512_and_si512(_mm512_slli_epi16(hv, 2), four));
        u[0][1] = _mm512_or_si512(u[0][1], _mm512_and_si512(_mm512_slli_epi16(hv, 1), four));
        u[0][2] = _mm512_or_si512(u[0][2], _mm512_and_si512(hv, four));
        u[0][3] = _mm512_or_si512(u[0][3], _mm512_and_si512(_mm512_srli_epi16(hv, 1), four));
        for (int sh = 0; sh < 4; ++sh) {
          u[1][sh] = _mm512_or_si512(u[1][sh], _mm512_and_si512(_mm512_srli_epi16(hv, 2 + sh), four));
        }
        const auto scales = [](const uint8_t* p0, const uint8_t* p1) {
          return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1))));
        };
        sc0 = scales(w0 + 16 + 16 * k, w1 + 16 + 16 * k);
        sc1 = scales(w0 + 24 + 16 * k, w1 + 24 + 16 * k);
        corr_pair = _mm512_setzero_si512();  // unused: the offsets carry Q3's correction
      } else {
        const __m128i s0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w0 + 32 + 16 * k));  // [h][r]: sc | m << 4
        const __m128i s1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w1 + 32 + 16 * k));
        const __m128i f = _mm_set1_epi8(15);
        const __m128i lo0 = _mm_and_si128(s0, f), lo1 = _mm_and_si128(s1, f);
        const __m128i hi0 = _mm_and_si128(_mm_srli_epi16(s0, 4), f), hi1 = _mm_and_si128(_mm_srli_epi16(s1, 4), f);
        sc0 = bytes16(lo0, lo1, false);
        sc1 = bytes16(lo0, lo1, true);
        corr_pair = _mm512_or_si512(_mm512_and_si512(bytes16(hi0, hi1, false), low16),
                                    _mm512_slli_epi32(bytes16(hi0, hi1, true), 16));
      }
      for (int m = 0; m < kVnniRows; ++m) {
        const int8_t* q = a[m][b].qs;
        __m512i s0 = Q3 ? _mm512_set1_epi32(offsets[m][2 * b]) : _mm512_setzero_si512();
        __m512i s1 = Q3 ? _mm512_set1_epi32(offsets[m][2 * b + 1]) : _mm512_setzero_si512();
        for (int sh = 0; sh < 4; ++sh) {
          s0 = _mm512_dpbusd_epi32(s0, u[0][sh], bcast4x16(q + 4 * sh));
          s1 = _mm512_dpbusd_epi32(s1, u[1][sh], bcast4x16(q + 16 + 4 * sh));
        }
        const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1));
        const __m512 da = _mm512_set1_ps(a[m][b].d);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, da), acc[m]);
        if constexpr (!Q3) {
          const __m512i corr = _mm512_madd_epi16(corr_pair, _mm512_set1_epi32(half_sums[m][b]));  // sum_h m_h A_h
          acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(corr), _mm512_mul_ps(mw, da), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < kVnniRows; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

void q2_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* half_sums,
                  int64_t nb, float* const* out) {
  q23_pair_tile<false>(w0, w1, a, half_sums, nullptr, nb, out);
}

void q3_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* offsets,
                  int64_t nb, float* const* out) {
  q23_pair_tile<true>(w0, w1, a, nullptr, offsets, nb, out);
}
KVGEN_VNNI_END

}  // namespace kvgen
