// Q6 (GGUF Q6_K repacked into 8-row groups, one record per 256-column super-block, see common.h) times Q8A
// activations: the file's own 6-bit weights, w = d * sc * (u - 32). Per 32-column block and group: 4 loads of low nibbles and 2 of high bits
// give 8 vectors of 6-bit u (4 columns x 8 rows each); maddubs(u, a) against 4 broadcast activation bytes,
// two summed in int16 (2 * 2 * 63 * 127 = 32,004 < 32,767), then madd with the row's int8 scale of that
// 16-column half h: sum_h sc_h * S_h in int32. Minus 32 * sum_h sc_h * A_h (A_h: the half's activation sum,
// computed once per call by activation_half_sums, one madd per block) gives the exact sum_h sc_h * sum (u - 32) a;
// acc += that * d_w * d_a. With AVX512-VNNI each half's int32 sum starts at -32 A_h instead (activation_half_offsets,
// once per call), then times sc_h: the same integer, three vector operations fewer a row and block. The arithmetic
// of a row does not depend on how many rows share the call.
// Source of the Q6_K values: ggml dequantize_row_q6_K; the algebra of ggml_vec_dot_q6_K_q8_K per 16 values.
#include <immintrin.h>

#include <cstring>

#include "common.h"

#ifndef KVGEN_Q6_PREFETCH
#define KVGEN_Q6_PREFETCH 3
#endif

namespace kvgen {
namespace {

// Per row r (int32 lane r) of a 32-column block: the scales sc_0[r], sc_1[r] of its two 16-column halves as int32,
// each in both int16 halves of a lane (the AVX2 madd partners of the pair sums), and the pair (sc_0[r], sc_1[r]) (the
// madd partner of the activation half sums).
struct Q6Scales {
  __m256i sc0, sc1, sc0x2, sc1x2, sc01;
};

// sum_h sc_h * S_h of one activation row's bytes q (S_h: the products of half h) in int32 per row: pairs of
// products summed in int16, two maddubs at a time, then madd with sc_h.
template <int MT>
inline __m256i q6_row_dot(const __m256i* u0, const __m256i* u1, const Q6Scales& sc, const int8_t* q) {
  __m256i dot = _mm256_setzero_si256();
#pragma GCC unroll 2
  for (int t = 0; t < 4; t += 2) {
    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_add_epi16(
        _mm256_maddubs_epi16(u0[t], bcast4(q + 4 * t)), _mm256_maddubs_epi16(u0[t + 1], bcast4(q + 4 * t + 4))),
        sc.sc0x2));
    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_add_epi16(
        _mm256_maddubs_epi16(u1[t], bcast4(q + 16 + 4 * t)), _mm256_maddubs_epi16(u1[t + 1], bcast4(q + 20 + 4 * t))),
        sc.sc1x2));
    if constexpr (MT > 1) keep_in_register(dot);  // one row: the tree GCC builds fits the registers
  }
  return dot;
}

KVGEN_VNNI_BEGIN
// sum_h sc_h * sum (u - 32) a with vpdpbusd (common.h): S_h - 32 A_h in int32 per half (each starting at -32 A_h,
// `offsets`; |S_h| <= 16 * 63 * 127), then times sc_h with vpmulld: q6_row_dot's sums minus their correction.
inline __m256i q6_row_dot_vnni(const __m256i* u0, const __m256i* u1, const Q6Scales& sc, const int8_t* q,
                               const int32_t* offsets) {
  __m256i s0 = _mm256_set1_epi32(offsets[0]), s1 = _mm256_set1_epi32(offsets[1]);
  for (int t = 0; t < 4; ++t) {
    s0 = _mm256_dpbusd_epi32(s0, u0[t], bcast4(q + 4 * t));
    s1 = _mm256_dpbusd_epi32(s1, u1[t], bcast4(q + 16 + 4 * t));
  }
  return _mm256_add_epi32(_mm256_mullo_epi32(s0, sc.sc0), _mm256_mullo_epi32(s1, sc.sc1));
}
KVGEN_VNNI_END

// MT activation rows against one group's Q6 records: row_dot(u0, u1, scales, m, b) gives sum_h sc_h * sum (u - 32) a
// of row m's block b. Always inlined, so a VNNI tile gets the loop in its own body with its row_dot inlined
// (common.h).
template <int MT, class RowDot>
__attribute__((always_inline)) inline void q6_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                   float* const* out, RowDot row_dot) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30), low16 = _mm256_set1_epi32(0xFFFF);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb, w += kQ6Record) {
    const char* ahead = reinterpret_cast<const char*>(w) + KVGEN_Q6_PREFETCH * kQ6Record;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    for (int k = 0; k < 8; ++k) {
      const int64_t b = 8 * sb + k;
      const uint8_t* blk = w + kQ6Block * k;  // sc at 16, lo at 32, hi at 160
      for (int c = 0; c < 256; c += 64) _mm_prefetch(ahead + 210 * k + c, _MM_HINT_T0);  // a record in 8 steps
      __m256i u0[4], u1[4];  // columns 4t+i (half 0) and 16+4t+i (half 1), 8 rows
      const __m256i h[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 160)),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 192))};
      for (int t = 0; t < 4; ++t) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * t));
        const __m256i hv = h[t >> 1];
        const __m256i b0 = (t & 1) ? hv : _mm256_slli_epi16(hv, 4);  // bits 4-5 of each byte: u >> 4
        const __m256i b1 = (t & 1) ? _mm256_srli_epi16(hv, 2) : _mm256_slli_epi16(hv, 2);
        u0[t] = _mm256_or_si256(_mm256_and_si256(p, low4), _mm256_and_si256(b0, top2));
        u1[t] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), low4), _mm256_and_si256(b1, top2));
      }
      Q6Scales sc;
      sc.sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 16)));
      sc.sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 24)));
      sc.sc0x2 = _mm256_or_si256(_mm256_and_si256(sc.sc0, low16), _mm256_slli_epi32(sc.sc0, 16));
      sc.sc1x2 = _mm256_or_si256(_mm256_and_si256(sc.sc1, low16), _mm256_slli_epi32(sc.sc1, 16));
      sc.sc01 = _mm256_or_si256(_mm256_and_si256(sc.sc0, low16), _mm256_slli_epi32(sc.sc1, 16));
      for (int m = 0; m < MT; ++m) {
        const __m256i dot = row_dot(u0, u1, sc, m, b);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a[m][b].d)), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

KVGEN_VNNI_BEGIN
template <int MT>
void q6_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* offsets, int64_t nb,
                  float* const* out) {
  q6_tile<MT>(w, a, nb, out, [a, offsets](const __m256i* u0, const __m256i* u1, const Q6Scales& sc, int m, int64_t b) {
    return q6_row_dot_vnni(u0, u1, sc, a[m][b].qs, offsets[m] + 2 * b);
  });
}
KVGEN_VNNI_END

// The sums of an activation block's two 16-value halves.
inline void half_sums_of(const BlockQ8A& block, int32_t& s0, int32_t& s1) {
  s0 = s1 = 0;
  for (int i = 0; i < 16; ++i) {
    s0 += block.qs[i];
    s1 += block.qs[16 + i];
  }
}

}  // namespace

void activation_half_sums(const BlockQ8A* a, int64_t n, int32_t* sums) {
  for (int64_t k = 0; k < n; ++k) {
    int32_t s0, s1;
    half_sums_of(a[k], s0, s1);
    sums[k] = static_cast<int32_t>((static_cast<uint32_t>(s1) << 16) | (static_cast<uint32_t>(s0) & 0xFFFFu));
  }
}

void activation_half_offsets(const BlockQ8A* a, int64_t n, int32_t factor, int32_t* offsets) {
  for (int64_t k = 0; k < n; ++k) {
    int32_t s0, s1;
    half_sums_of(a[k], s0, s1);
    offsets[2 * k] = factor * s0;
    offsets[2 * k + 1] = factor * s1;
  }
}

void q6_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_sums,
              const int32_t* const* offsets, int mt, int64_t nb, float* const* out) {
  if (offsets != nullptr) {
    return vnni_tile_rows(mt, [&](auto MT, int r) { q6_tile_vnni<MT>(w, a + r, offsets + r, nb, out + r); });
  }
  tile_rows(mt, [&](auto MT) {
    q6_tile<MT>(w, a, nb, out, [a, half_sums](const __m256i* u0, const __m256i* u1, const Q6Scales& sc, int m,
                                               int64_t b) {
      const __m256i dot = q6_row_dot<decltype(MT)::value>(u0, u1, sc, a[m][b].qs);
      // minus 32 * (sc_0 A_0 + sc_1 A_1): u = q + 32, A_h the activation half sums (int16 pair per block)
      const __m256i corr = _mm256_madd_epi16(sc.sc01, _mm256_set1_epi32(half_sums[m][b]));
      return _mm256_sub_epi32(dot, _mm256_slli_epi32(corr, 5));
    });
  });
}

KVGEN_VNNI_BEGIN
// The pair tile (common.h): lane by lane the operations of q6_tile_vnni<8>.
void q6_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* offsets,
                       int64_t nb, float* const* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  __m512 acc[kVnniRows];
  for (int m = 0; m < kVnniRows; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb, w0 += kQ6Record, w1 += kQ6Record) {
    const __m512 dw = pair_halves(w0, w1);
    for (int k = 0; k < 8; ++k) {
      const int64_t b = 8 * sb + k;
      const uint8_t* blk0 = w0 + kQ6Block * k;  // sc at 16, lo at 32, hi at 160
      const uint8_t* blk1 = w1 + kQ6Block * k;
      prefetch_pair(w0, w1, KVGEN_Q6_PREFETCH * kQ6Record + 210 * k, 256);  // a record in 8 steps, as q6_tile
      __m512i u0[4], u1[4];
      const __m512i h[2] = {pair_bytes(blk0 + 160, blk1 + 160), pair_bytes(blk0 + 192, blk1 + 192)};
      for (int t = 0; t < 4; ++t) {
        const __m512i p = pair_bytes(blk0 + 32 + 32 * t, blk1 + 32 + 32 * t);
        const __m512i hv = h[t >> 1];
        const __m512i b0 = (t & 1) ? hv : _mm512_slli_epi16(hv, 4);
        const __m512i b1 = (t & 1) ? _mm512_srli_epi16(hv, 2) : _mm512_slli_epi16(hv, 2);
        u0[t] = _mm512_or_si512(_mm512_and_si512(p, low4), _mm512_and_si512(b0, top2));
        u1[t] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p, 4), low4), _mm512_and_si512(b1, top2));
      }
      const auto scales = [](const uint8_t* p0, const uint8_t* p1) {  // 8 int8 of each group as int32
        return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1))));
      };
      const __m512i sc0 = scales(blk0 + 16, blk1 + 16), sc1 = scales(blk0 + 24, blk1 + 24);
      for (int m = 0; m < kVnniRows; ++m) {
        const int8_t* q = a[m][b].qs;
        const int32_t* off = offsets[m] + 2 * b;
        __m512i s0 = _mm512_set1_epi32(off[0]), s1 = _mm512_set1_epi32(off[1]);
        for (int t = 0; t < 4; ++t) {
          s0 = _mm512_dpbusd_epi32(s0, u0[t], bcast4x16(q + 4 * t));
          s1 = _mm512_dpbusd_epi32(s1, u1[t], bcast4x16(q + 16 + 4 * t));
        }
        const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(a[m][b].d)), acc[m]);
      }
    }
  }
  for (int m = 0; m < kVnniRows; ++m) _mm512_storeu_ps(out[m], acc[m]);
}
KVGEN_VNNI_END

}  // namespace kvgen
