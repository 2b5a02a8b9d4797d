// IQ4 (GGUF IQ4_NL repacked into 8-row groups; see common.h), MXFP4 (the same record, another table of values) and
// IQ4_XS (super-block records: 6-bit scales ls, sc = ls - 32, under an fp16 d; also the lattice and ternary types
// recoded into them, recode.cpp, each with its table: xs_table) and XS16 (IQ4_XS's indices under an int8 scale per 16
// columns: IQ2_XS, IQ2_S, IQ1_M, xs16_table) times Q8A activations. Per 32-column
// block and group: 4 loads of 32 bytes hold the 8 rows' nibbles (low: columns 4t+i, high: 16+4t+i, as the Q4 record); one
// pshufb per half turns the nibbles into their int8 values (kIQ4Values or kMXFP4Values), which are then a Q8 kernel's 4 columns x 8 rows: maddubs(|w|, sign(a, w)), madd to int32 per half (two int16
// pair sums of up to 2 * 127 * 127 could overflow), acc += dot * d_w * d_a. With AVX512-VNNI the table's values plus
// 128 (unsigned) go into vpdpbusd against the activations as they are, minus 128 x each activation block's sum (made
// once a call): no vpsignb at all. qgemm 3072 x 768, 2 threads, in-process A/B against vpdpbusd(|v|, sign(a, v)):
// IQ4_NL 1.18-1.37x, IQ4_XS 1.21-1.42x, MXFP4 1.19-1.42x at M = 1-256, the same int32 sums.
// Source: llama.cpp ggml_vec_dot_iq4_nl_q8_0 (the lookup by shuffle), our qgemm_q8.cpp (the products).
// The arithmetic of a row does not depend on how many rows share the call.
#include <immintrin.h>

#include <cstring>

#include "common.h"

#ifndef KVGEN_IQ4_PREFETCH
#define KVGEN_IQ4_PREFETCH 32
#endif
#ifndef KVGEN_IQ4XS_PREFETCH
#define KVGEN_IQ4XS_PREFETCH 4
#endif

namespace kvgen {
namespace {

// The int8 values (the 16-entry table `values`) of the 32 bytes of nibbles at p: lo of the low nibbles, hi of the high.
inline void lookup(const uint8_t* p, __m256i values, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_shuffle_epi8(values, _mm256_and_si256(v, low4));
  hi = _mm256_shuffle_epi8(values, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
}

// sc (int32 lanes) in both int16 halves of each lane: madd's partner.
inline __m256i int16_pairs(__m256i sc) {
  return _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16));
}

// sum[m]: int32 per row of the 8 rows' 4-bit indices qs[4][8][4] (the IQ4 record's layout), looked up in `values`,
// times activation block b of row m, times the row's int32 scale: sc for columns 0-15 and sc_hi for 16-31 (1, IQ4_XS's
// ls - 32 for both, or the XS16 record's two; |sum| <= 32 * 127 * 127 * 32 < 2^31): maddubs(|v|, sign(a, v)) pairs,
// then madd with the scale in both int16 halves of a lane.
template <int MT>
inline void iq4_sums(const uint8_t* qs, const BlockQ8A* const* a, int64_t b, __m256i values, __m256i sc,
                     __m256i sc_hi, __m256i* sum) {
  const __m256i scale = int16_pairs(sc), scale_hi = int16_pairs(sc_hi);
  for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {
    __m256i lo, hi;  // the values of columns 4t+i and 16+4t+i, 8 rows
    lookup(qs + 32 * t, values, lo, hi);
    const __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
    for (int m = 0; m < MT; ++m) {
      const int8_t* q = a[m][b].qs;
      const __m256i plo = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(bcast4(q + 4 * t), lo));
      const __m256i phi = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(bcast4(q + 16 + 4 * t), hi));
      sum[m] = _mm256_add_epi32(sum[m], _mm256_add_epi32(_mm256_madd_epi16(plo, scale), _mm256_madd_epi16(phi, scale_hi)));
      if constexpr (MT > 1) keep_in_register(sum[m]);  // one row: the tree GCC builds fits the registers
    }
  }
}

KVGEN_VNNI_BEGIN
// iq4_sums with vpdpbusd, the table's values offset by 128 (u = v + 128 = v ^ 0x80 as uint8: `values` holds those,
// vpdpbusd's unsigned operand) against the activations as they are: sum(u a) = dot + 128 sum(a), minus
// block_sums[m][b] (128 sum(a), activation_block_sums). Where vpdpbusd(|v|, sign(a, v)) took two vpsignb a product,
// no sign is needed. Two running sums a row, then times sc with vpmulld where Scaled. The same int32 sums as
// iq4_sums (|sum(u a)| < 32 * 241 * 127).
template <int MT>
inline void iq4_parts_vnni(const uint8_t* qs, const BlockQ8A* const* a, int64_t b, __m256i values,
                           __m256i (*part)[2]) {
  for (int m = 0; m < MT; ++m) part[m][0] = part[m][1] = _mm256_setzero_si256();
  for (int t = 0; t < 4; ++t) {
    __m256i lo, hi;  // the offset values of columns 4t+i and 16+4t+i, 8 rows
    lookup(qs + 32 * t, values, lo, hi);
    for (int m = 0; m < MT; ++m) {
      const int8_t* q = a[m][b].qs;
      part[m][0] = _mm256_dpbusd_epi32(part[m][0], lo, bcast4(q + 4 * t));
      part[m][1] = _mm256_dpbusd_epi32(part[m][1], hi, bcast4(q + 16 + 4 * t));
    }
  }
}

template <int MT, bool Scaled>
inline void iq4_sums_vnni(const uint8_t* qs, const BlockQ8A* const* a, const int32_t* const* block_sums, int64_t b,
                          __m256i values, __m256i sc, __m256i* sum) {
  __m256i part[MT][2];  // sum(u a) of columns 0-15 and 16-31
  iq4_parts_vnni<MT>(qs, a, b, values, part);
  for (int m = 0; m < MT; ++m) {
    sum[m] = _mm256_sub_epi32(_mm256_add_epi32(part[m][0], part[m][1]), _mm256_set1_epi32(block_sums[m][b]));
    if constexpr (Scaled) sum[m] = _mm256_mullo_epi32(sum[m], sc);
  }
}

// The XS16 record's sums (a scale per 16 columns): each half's sum(u a) plus half_offsets[m][2b + h] (-128 x that
// half's activation sum, activation_half_offsets), times its scale: the integer iq4_sums gives.
template <int MT>
inline void iq4_sums_halves_vnni(const uint8_t* qs, const BlockQ8A* const* a, const int32_t* const* half_offsets,
                                 int64_t b, __m256i values, __m256i sc, __m256i sc_hi, __m256i* sum) {
  __m256i part[MT][2];
  iq4_parts_vnni<MT>(qs, a, b, values, part);
  for (int m = 0; m < MT; ++m) {
    const __m256i lo = _mm256_add_epi32(part[m][0], _mm256_set1_epi32(half_offsets[m][2 * b]));
    const __m256i hi = _mm256_add_epi32(part[m][1], _mm256_set1_epi32(half_offsets[m][2 * b + 1]));
    sum[m] = _mm256_add_epi32(_mm256_mullo_epi32(lo, sc), _mm256_mullo_epi32(hi, sc_hi));
  }
}
KVGEN_VNNI_END

// The 16 values of `table` in both lanes; with Offset, plus 128 as uint8 (v ^ 0x80: the VNNI sums' operand).
template <bool Offset>
inline __m256i table_values(const int8_t* table) {
  const __m256i values = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
  return Offset ? _mm256_xor_si256(values, _mm256_set1_epi8(static_cast<char>(0x80))) : values;
}

// The IQ4_NL / MXFP4 tile (the 16 values in `table`) and the IQ4_XS tile: sums(qs, b, values, sc, sum) gives the
// int32 dots (iq4_sums, or with Offset its VNNI twin). Always inlined, so a VNNI tile gets the loop in its own body
// with its sums inlined (common.h).
template <int MT, bool Offset, class Sums>
__attribute__((always_inline)) inline void iq4_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                    float* const* out, const int8_t* table, Sums sums) {
  const __m256i values = table_values<Offset>(table);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kIQ4Record) {
    const char* ahead = reinterpret_cast<const char*>(w) + KVGEN_IQ4_PREFETCH * kIQ4Record;  // ~4.5 KB, as Q4
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    __m256i sum[MT];
    sums(w + 16, b, values, _mm256_set1_epi32(1), _mm256_set1_epi32(1), sum);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), _mm256_mul_ps(dw, _mm256_set1_ps(a[m][b].d)), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

// scales: null (each record's scales unpacked in the loop by iq4xs_scales, from the record just read) or the group's,
// unpacked by qgemm once for its several tiles (64 bytes a record), as k_quant_tile (common.h). Halves: the XS16
// record (common.h), whose int8 scales per 16 columns are read as they are.
template <int MT, bool Offset, bool kUnpack, class Sums, bool Halves = false>
__attribute__((always_inline)) inline void iq4xs_tile_body(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                           float* const* out, const int8_t* scales,
                                                           const int8_t* table, Sums sums) {
  constexpr int64_t kRecord = Halves ? kXS16Record : kIQ4XSRecord, kQs = Halves ? 144 : 64;
  constexpr int64_t kStep = kRecord / 8;  // prefetch a record ahead in 8 steps (3 lines each)
  const __m256i values = table_values<Offset>(table);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  alignas(32) int8_t unpacked[kUnpack ? 64 : 1];
  for (int64_t sb = 0; sb < nb / 8; ++sb, w += kRecord) {
    const char* ahead = reinterpret_cast<const char*>(w) + KVGEN_IQ4XS_PREFETCH * kRecord;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const int8_t* sm = Halves ? reinterpret_cast<const int8_t*>(w + 16) : kUnpack ? unpacked : scales + 64 * sb;
    if constexpr (kUnpack) iq4xs_scales(w + 16, unpacked);
    for (int k = 0; k < 8; ++k) {
      const int64_t b = 8 * sb + k;
      _mm_prefetch(ahead + kStep * k, _MM_HINT_T0);
      _mm_prefetch(ahead + kStep * k + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + kStep * k + 128, _MM_HINT_T0);
      // each row's ls - 32 (Halves: its scale of columns 0-15, then of 16-31)
      const int8_t* sk = sm + (Halves ? 16 : 8) * k;
      const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sk)));
      const __m256i sc_hi =
          Halves ? _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sk + 8))) : sc;
      __m256i sum[MT];
      sums(w + kQs + 128 * k, b, values, sc, sc_hi, sum);
      for (int m = 0; m < MT; ++m) {
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), _mm256_mul_ps(dw, _mm256_set1_ps(a[m][b].d)), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

template <int MT, bool Offset, class Sums>
__attribute__((always_inline)) inline void iq4xs_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                      float* const* out, const int8_t* scales, const int8_t* table,
                                                      Sums sums) {
  if (scales == nullptr) return iq4xs_tile_body<MT, Offset, true>(w, a, nb, out, scales, table, sums);
  iq4xs_tile_body<MT, Offset, false>(w, a, nb, out, scales, table, sums);
}

KVGEN_VNNI_BEGIN
template <int MT>
void iq4_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* bs, int64_t nb, float* const* out,
                   const int8_t* table) {
  iq4_tile<MT, true>(w, a, nb, out, table, [a, bs](const uint8_t* qs, int64_t b, __m256i v, __m256i sc, __m256i,
                                                   __m256i* sum) { iq4_sums_vnni<MT, false>(qs, a, bs, b, v, sc, sum); });
}

template <int MT>
void iq4xs_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* bs, int64_t nb,
                     float* const* out, const int8_t* scales, const int8_t* table) {
  iq4xs_tile<MT, true>(w, a, nb, out, scales, table, [a, bs](const uint8_t* qs, int64_t b, __m256i v, __m256i sc,
                                                                 __m256i, __m256i* sum) {
    iq4_sums_vnni<MT, true>(qs, a, bs, b, v, sc, sum);
  });
}

template <int MT>
void xs16_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* ho, int64_t nb, float* const* out,
                    const int8_t* table) {
  auto sums = [a, ho](const uint8_t* qs, int64_t b, __m256i v, __m256i sc, __m256i sc_hi, __m256i* sum) {
    iq4_sums_halves_vnni<MT>(qs, a, ho, b, v, sc, sc_hi, sum);
  };
  iq4xs_tile_body<MT, true, false, decltype(sums), true>(w, a, nb, out, nullptr, table, sums);
}
KVGEN_VNNI_END

}  // namespace

void activation_block_sums(const BlockQ8A* a, int64_t n, int32_t* sums) {
  for (int64_t k = 0; k < n; ++k) {
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) s += a[k].qs[i];
    sums[k] = 128 * s;
  }
}

void iq4_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* block_sums, int mt, int64_t nb,
               float* const* out, const int8_t* values) {
  if (block_sums != nullptr) {
    return vnni_tile_rows(mt, [&](auto MT, int r) {
      iq4_tile_vnni<MT>(w, a + r, block_sums + r, nb, out + r, values);
    });
  }
  tile_rows(mt, [&](auto MT) {
    iq4_tile<MT, false>(w, a, nb, out, values, [a](const uint8_t* qs, int64_t b, __m256i v, __m256i sc,
                                                   __m256i sc_hi, __m256i* sum) {
      iq4_sums<decltype(MT)::value>(qs, a, b, v, sc, sc_hi, sum);
    });
  });
}

void iq4xs_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* block_sums, int mt, int64_t nb,
                 float* const* out, const int8_t* scales, const int8_t* table) {
  if (block_sums != nullptr) {
    return vnni_tile_rows(mt, [&](auto MT, int r) {
      iq4xs_tile_vnni<MT>(w, a + r, block_sums + r, nb, out + r, scales, table);
    });
  }
  tile_rows(mt, [&](auto MT) {
    iq4xs_tile<MT, false>(w, a, nb, out, scales, table,
                          [a](const uint8_t* qs, int64_t b, __m256i v, __m256i sc, __m256i sc_hi, __m256i* sum) {
                            iq4_sums<decltype(MT)::value>(qs, a, b, v, sc, sc_hi, sum);
                          });
  });
}

void xs16_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_offsets, int mt, int64_t nb,
                float* const* out, const int8_t* table) {
  if (half_offsets != nullptr) {
    return vnni_tile_rows(mt, [&](auto MT, int r) {
      xs16_tile_vnni<MT>(w, a + r, half_offsets + r, nb, out + r, table);
    });
  }
  tile_rows(mt, [&](auto MT) {
    auto sums = [a](const uint8_t* qs, int64_t b, __m256i v, __m256i sc, __m256i sc_hi, __m256i* sum) {
      iq4_sums<decltype(MT)::value>(qs, a, b, v, sc, sc_hi, sum);
    };
    iq4xs_tile_body<decltype(MT)::value, false, false, decltype(sums), true>(w, a, nb, out, nullptr, table, sums);
  });
}

KVGEN_VNNI_BEGIN
namespace {

// iq4_sums_vnni of two groups' indices (the pair tiles, common.h) for kVnniRows activation rows: `values` holds the
// offset table in all four 128-bit lanes; Scaled: times each row's sc (16 lanes: both groups' rows).
inline void pair_iq4_parts(const uint8_t* qs0, const uint8_t* qs1, const BlockQ8A* const* a, int64_t b,
                           __m512i values, __m512i (*part)[2]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int m = 0; m < kVnniRows; ++m) part[m][0] = part[m][1] = _mm512_setzero_si512();
  for (int t = 0; t < 4; ++t) {
    const __m512i p = pair_bytes(qs0 + 32 * t, qs1 + 32 * t);
    const __m512i lo = _mm512_shuffle_epi8(values, _mm512_and_si512(p, low4));
    const __m512i hi = _mm512_shuffle_epi8(values, _mm512_and_si512(_mm512_srli_epi16(p, 4), low4));
    for (int m = 0; m < kVnniRows; ++m) {
      part[m][0] = _mm512_dpbusd_epi32(part[m][0], lo, bcast4x16(a[m][b].qs + 4 * t));
      part[m][1] = _mm512_dpbusd_epi32(part[m][1], hi, bcast4x16(a[m][b].qs + 16 + 4 * t));
    }
  }
}

template <bool Scaled>
inline void pair_iq4_sums(const uint8_t* qs0, const uint8_t* qs1, const BlockQ8A* const* a,
                          const int32_t* const* block_sums, int64_t b, __m512i values, __m512i sc, __m512i* sum) {
  __m512i part[kVnniRows][2];
  pair_iq4_parts(qs0, qs1, a, b, values, part);
  for (int m = 0; m < kVnniRows; ++m) {
    sum[m] = _mm512_sub_epi32(_mm512_add_epi32(part[m][0], part[m][1]), _mm512_set1_epi32(block_sums[m][b]));
    if constexpr (Scaled) sum[m] = _mm512_mullo_epi32(sum[m], sc);
  }
}

// The 16 values of `table` plus 128 as uint8 (iq4_sums_vnni's operand) in all four lanes.
inline __m512i pair_table(const int8_t* table) {
  return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table))),
                          _mm512_set1_epi8(static_cast<char>(0x80)));
}

}  // namespace

// The pair tiles (common.h): lane by lane the operations of iq4_tile_vnni<8> and iq4xs_tile_vnni<8>.
void iq4_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* block_sums,
                   int64_t nb, float* const* out, const int8_t* table) {
  const __m512i values = pair_table(table);
  __m512 acc[kVnniRows];
  for (int m = 0; m < kVnniRows; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w0 += kIQ4Record, w1 += kIQ4Record) {
    prefetch_pair(w0, w1, KVGEN_IQ4_PREFETCH * kIQ4Record, 192);  // 3 lines, as iq4_tile
    __m512i sum[kVnniRows];
    pair_iq4_sums<false>(w0 + 16, w1 + 16, a, block_sums, b, values, _mm512_set1_epi32(1), sum);
    const __m512 dw = pair_halves(w0, w1);
    for (int m = 0; m < kVnniRows; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_mul_ps(dw, _mm512_set1_ps(a[m][b].d)), acc[m]);
    }
  }
  for (int m = 0; m < kVnniRows; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

void iq4xs_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* block_sums,
                     int64_t nb, float* const* out, const int8_t* scales0, const int8_t* scales1,
                     const int8_t* table) {
  constexpr int64_t kStep = kIQ4XSRecord / 8;
  const __m512i values = pair_table(table);
  __m512 acc[kVnniRows];
  for (int m = 0; m < kVnniRows; ++m) acc[m] = _mm512_setzero_ps();
  const bool unpack = scales0 == nullptr;  // null: each record's scales unpacked in the loop (as iq4xs_tile)
  alignas(32) int8_t unpacked[2][64];
  for (int64_t sb = 0; sb < nb / 8; ++sb, w0 += kIQ4XSRecord, w1 += kIQ4XSRecord) {
    const __m512 dw = pair_halves(w0, w1);
    if (unpack) {
      iq4xs_scales(w0 + 16, unpacked[0]);
      iq4xs_scales(w1 + 16, unpacked[1]);
    }
    const int8_t* sm0 = unpack ? unpacked[0] : scales0 + 64 * sb;
    const int8_t* sm1 = unpack ? unpacked[1] : scales1 + 64 * sb;
    for (int k = 0; k < 8; ++k) {
      const int64_t b = 8 * sb + k;
      prefetch_pair(w0, w1, KVGEN_IQ4XS_PREFETCH * kIQ4XSRecord + kStep * k, 192);
      const __m512i sc = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(  // each row's ls - 32
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm0 + 8 * k)),
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm1 + 8 * k))));
      __m512i sum[kVnniRows];
      pair_iq4_sums<true>(w0 + 64 + 128 * k, w1 + 64 + 128 * k, a, block_sums, b, values, sc, sum);
      for (int m = 0; m < kVnniRows; ++m) {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_mul_ps(dw, _mm512_set1_ps(a[m][b].d)), acc[m]);
      }
    }
  }
  for (int m = 0; m < kVnniRows; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

// Lane by lane the operations of xs16_tile_vnni<8> (iq4_sums_halves_vnni), for a pair of groups.
void xs16_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* half_offsets,
                    int64_t nb, float* const* out, const int8_t* table) {
  constexpr int64_t kStep = kXS16Record / 8;
  const __m512i values = pair_table(table);
  __m512 acc[kVnniRows];
  for (int m = 0; m < kVnniRows; ++m) acc[m] = _mm512_setzero_ps();
  const auto scales = [](const uint8_t* s0, const uint8_t* s1) {  // 8 int8 scales of each group, as 16 int32
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s0)),
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s1))));
  };
  for (int64_t sb = 0; sb < nb / 8; ++sb, w0 += kXS16Record, w1 += kXS16Record) {
    const __m512 dw = pair_halves(w0, w1);
    for (int k = 0; k < 8; ++k) {
      const int64_t b = 8 * sb + k;
      prefetch_pair(w0, w1, KVGEN_IQ4XS_PREFETCH * kXS16Record + kStep * k, 192);
      const __m512i sc = scales(w0 + 16 + 16 * k, w1 + 16 + 16 * k), sc_hi = scales(w0 + 24 + 16 * k, w1 + 24 + 16 * k);
      __m512i part[kVnniRows][2];
      pair_iq4_parts(w0 + 144 + 128 * k, w1 + 144 + 128 * k, a, b, values, part);
      for (int m = 0; m < kVnniRows; ++m) {
        const __m512i lo = _mm512_add_epi32(part[m][0], _mm512_set1_epi32(half_offsets[m][2 * b]));
        const __m512i hi = _mm512_add_epi32(part[m][1], _mm512_set1_epi32(half_offsets[m][2 * b + 1]));
        const __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(lo, sc), _mm512_mullo_epi32(hi, sc_hi));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(a[m][b].d)), acc[m]);
      }
    }
  }
  for (int m = 0; m < kVnniRows; ++m) _mm512_storeu_ps(out[m], acc[m]);
}
KVGEN_VNNI_END

}  // namespace kvgen
