// Q4 (GGUF Q4_1 repacked into 8-row groups, see common.h), Q4_0 (its record without m: m = -8 d, computed) and Q4_K
// (super-block records: byte scales and mins under fp16 d, dmin) times Q8A activations.
// Per 32-column block and group: 4 loads of 32 bytes give 8 vectors of 4 columns x 8 rows
// (low and high nibbles); maddubs against 4 broadcast activation bytes, int16 sums over
// the 8 vectors (8 * 2 * 15 * 127 = 30,480 < 32,767, exact), one madd to int32 per row, then
//   Q4, Q4_0: acc += dot * d_w * d_a + m_w * s_a (llama.cpp ggml_vec_dot_q4_1_q8_1 algebra);
//   Q4_K: the same with d_w = d sc and m_w = -dmin m of the block (ggml dequantize_row_q4_K's values), in fp32.
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

constexpr int64_t kPrefetchRecords = KVGEN_Q4_PREFETCH;

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

// ~5 KB ahead of a Q4 record: enough records in flight to cover DRAM latency (measured: 8 ahead left half the
// bandwidth unused on cold weights).
template <int64_t kRecord>
inline void q4_prefetch(const uint8_t* w) {
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchRecords * kRecord;
  _mm_prefetch(ahead, _MM_HINT_T0);
  _mm_prefetch(ahead + 64, _MM_HINT_T0);
  _mm_prefetch(ahead + 128, _MM_HINT_T0);
}

// acc[m] += dot[m] * d_w * d_a + m_w * s_a for the Q4 record at w and activation block b (dot: the int32 dots of the
// record's nibbles with the block's bytes).
template <int MT, bool HasMin>
inline void q4_accumulate(const uint8_t* w, const BlockQ8A* const* a, int64_t b, const __m256i* dot, __m256* acc) {
  const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  // Q4_0: m = -8 d, the value the Q4 record stored (exact: a power of two times an fp16)
  const __m256 mw = HasMin ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)))
                           : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(dw, _mm256_set1_ps(a[m][b].d)), acc[m]);
    acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a[m][b].s), acc[m]);
  }
}

template <int MT, bool HasMin>
void q4_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out) {
  constexpr int64_t kRecord = HasMin ? kQ4Record : kQ40Record, kQs = HasMin ? 32 : 16;  // record size, nibbles' offset
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kRecord) {
    q4_prefetch<kRecord>(w);
    __m256i sum[MT], dot[MT];
    nibble_sums<MT>(w + kQs, a, b, sum);
    for (int m = 0; m < MT; ++m) dot[m] = _mm256_madd_epi16(sum[m], _mm256_set1_epi16(1));
    q4_accumulate<MT, HasMin>(w, a, b, dot, acc);
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

KVGEN_VNNI_BEGIN
// q4_tile with vpdpbusd: each nibble vector's products with 4 broadcast activation bytes summed straight into the
// int32 lanes (common.h). A row's 8 products per block go to kChains running sums, added at the end (exact): one
// chain of 8 dependent vpdpbusd per row kept the tile waiting on their latency.
template <int MT, bool HasMin>
void q4_tile_vnni(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out) {
  constexpr int64_t kRecord = HasMin ? kQ4Record : kQ40Record, kQs = HasMin ? 32 : 16;
  constexpr int kChains = MT == 1 ? 4 : 2;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kRecord) {
    q4_prefetch<kRecord>(w);
    __m256i part[MT][kChains], dot[MT];
    for (int m = 0; m < MT; ++m)
      for (int c = 0; c < kChains; ++c) part[m][c] = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kQs + 32 * t));
      const __m256i lo = _mm256_and_si256(p, low4), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
      const int c = 2 * (t % (kChains / 2));
      for (int m = 0; m < MT; ++m) {
        part[m][c] = _mm256_dpbusd_epi32(part[m][c], lo, bcast4(a[m][b].qs + 4 * t));
        part[m][c + 1] = _mm256_dpbusd_epi32(part[m][c + 1], hi, bcast4(a[m][b].qs + 16 + 4 * t));
      }
    }
    for (int m = 0; m < MT; ++m) {
      dot[m] = _mm256_add_epi32(part[m][0], part[m][1]);
      if constexpr (kChains == 4) dot[m] = _mm256_add_epi32(dot[m], _mm256_add_epi32(part[m][2], part[m][3]));
    }
    q4_accumulate<MT, HasMin>(w, a, b, dot, acc);
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], acc[m]);
}
KVGEN_VNNI_END

// Q4_K: block k's nibbles at 160 + 128k of a super-block record (k_quant_tile in common.h).
template <int MT>
void q4k_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb, float* const* out) {
  k_quant_tile<MT, kQ4KRecord, KVGEN_Q4K_PREFETCH>(w, a, nb, out, [a](const uint8_t* r, int k, int64_t b, __m256i* dot) {
    __m256i sum[MT];
    nibble_sums<MT>(r + 160 + 128 * k, a, b, sum);
    for (int m = 0; m < MT; ++m) dot[m] = _mm256_madd_epi16(sum[m], _mm256_set1_epi16(1));
  });
}

template <bool HasMin>
void group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  if (use_vnni()) return tile_rows(mt, [&](auto MT) { q4_tile_vnni<MT, HasMin>(w, a, nb, out); });
  tile_rows(mt, [&](auto MT) { q4_tile<MT, HasMin>(w, a, nb, out); });
}

}  // namespace

void q4k_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  tile_rows(mt, [&](auto MT) { q4k_tile<MT>(w, a, nb, out); });
}

void q4_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  group<true>(w, a, mt, nb, out);
}

void q40_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out) {
  group<false>(w, a, mt, nb, out);
}

}  // namespace kvgen
