// Shared block layouts of kvgen's CPU kernels (compiled with -mavx2 -mfma -mf16c).
//
// Activations: one BlockQ8A per 32 values of a row (llama.cpp's block_q8_1, with fp32
// scale and sum): d = max|x| / 127, qs = round_half_even(x * 127 / max|x|), s = d * sum(qs).
//
// Weights are repacked at load into 8-row groups ("row-interleaved"), one record per
// (group, 32-column block), groups of a matrix contiguous ([G, nb, record]):
//   Q4 record (160 bytes), from GGUF block_q4_0 / block_q4_1:
//     fp16 d[8], fp16 m[8] (row r of the group: w = q * d[r] + m[r]; Q4_0 has m = -8 d),
//     uint8 qs[4][8][4]: qs[t][r][i] = byte 4t+i of row r's GGUF block (low nibble =
//     column 4t+i, high nibble = column 16+4t+i).
//   Q4_0 record (144 bytes), from GGUF block_q4_0: the Q4 record without m (fp16 d[8], then qs at 16): w = (q - 8) d,
//     the Q4 kernel's arithmetic with m = -8 d (exact); 4.5 bits a weight as the file's, not the Q4 record's 5.
//   Q8 record (272 bytes), from GGUF block_q8_0:
//     fp16 d[8], uint8 u[8][8][4]: u[j][r][i] = q + 128 (q ^ 0x80) of row r, column 4j+i (w = (u - 128) * d[r]):
//     vpdpbusd's unsigned operand as stored.
//   F16 record (512 bytes), from GGUF F16 rows: fp16 w[32][8]: w[c][r] = row r, column c (float32
//     activations, not quantized: the file's weights times the activations as they are).
//   BF16 record (512 bytes), from GGUF BF16 rows: the same with bfloat16 values.
//   Q6 record (1680 bytes per 8 rows x 256 columns: one GGUF block_q6_K super-block of each row): fp16 d[8] (each
//     row's super-block scale), then per 32-column block k at 208k (so its fields sit at the offsets below from
//     there, 16 .. 207): int8 sc[2][8] at 16 (sc[h][r]: the scale of columns 16h .. 16h+15 of row r), then the 6-bit
//     values u = q + 32 in [0, 63] (w = d * sc * (u - 32)):
//     uint8 lo[4][8][4] at 32: lo[t][r][i] = low nibble of column 4t+i | low nibble of column 16+4t+i << 4,
//     uint8 hi[2][8][4] at 160: hi[v][r][i] = the top 2 bits of columns 8v+i, 16+8v+i, 8v+4+i, 16+8v+4+i
//     at bits 0, 2, 4, 6 (so hi[v] completes lo[2v] with bits 0-3 and lo[2v+1] with bits 4-7). 6.5625 bits a
//     weight, the file's (d once per super-block; it was repeated per 32 columns, 7 bits).
//   Q5 record (192 bytes), from GGUF block_q5_1: the Q4
//     record (fp16 d[8], fp16 m[8], qs[4][8][4] low nibbles), then uint8 qh[8][4]:
//     qh[r][i] bit t = the high bit of column 4t+i, bit 4+t = that of column 16+4t+i (w = (nibble | 16 hb) d + m).
//   Q5_0 record (176 bytes), from GGUF block_q5_0: the Q5 record without m (fp16 d[8], qs at 16, qh at 144): m = -16 d,
//     computed (exact); 5.5 bits a weight as the file's, not the Q5 record's 6.
//   IQ4 record (144 bytes), from GGUF block_iq4_nl: fp16 d[8], then
//     qs[4][8][4] as the Q4 record's; w = d * kIQ4Values[nibble] (llama.cpp's kvalues_iq4nl, non-linear).
//   MXFP4 record (144 bytes), from GGUF block_mxfp4 (E8M0 exponent e, 16 bytes of FP4 E2M1 indices): the IQ4
//     record with d = 2^(e - 128) as fp16 (exact for e in 104 .. 143) and w = d * kMXFP4Values[nibble].
//   Q2 record (672 bytes per 8 rows x 256 columns: one GGUF block_q2_K super-block of each row):
//     fp16 d[8], fp16 dmin[8], uint8 scales[16][8] (scales[g][r]: the file's byte of row r's 16 columns 16g ..:
//     sc in the low, m in the high nibble), then per 32-column block k and half h (16 columns) uint8 qs[4][8][4]
//     at 160 + 64k + 32h: bits 2s .. 2s+1 of byte 4r+i = u of column 32k + 16h + 4s + i (w = d sc u - dmin m).
//   Q3 record (912 bytes per 8 rows x 256 columns, from block_q3_K): fp16 d[8], int8 sc[16][8] (s - 32), the
//     2-bit planes of Q2's layout at 144, then per block k uint8 hb[8][4] at 656 + 32k: bit 4h + s of byte 4r+i =
//     the third bit of that column (u = low | 4 hb in [0, 7], w = d sc (u - 4); Q3_K's hmask bit set: no -4).
//     3.5625 bits a weight, the file's 3.4375 plus the scales as bytes: packed as the Q4_K record's, their unpacking
//     (per record in the tile, or per group) made 1.1B Q3_K_M decode 1.8 % and Q3_K qgemm at M = 8-512 ~3 % slower.
//   Q4_K record (1152 bytes per 8 rows x 256 columns: one GGUF block_q4_K super-block of each row): fp16 d[8],
//     fp16 dmin[8], the 6-bit scales sc[k][r] and mins m[k][r] of 32-column block k of row r (the file's 12 bytes a
//     row, regrouped so that one pass of vector shifts and masks per record unpacks them, k_scales_mins): at 32 + 8k
//     + r the low 4 bits of sc[k][r] | those of m[k][r] << 4, at 96 + 8k + r (k < 4) the top 2 bits of sc[k][r],
//     sc[k + 4][r], m[k][r], m[k + 4][r] at bits 0, 2, 4, 6; then per block k at 128 + 128k the Q4 record's
//     qs[4][8][4] (w = d sc q - dmin m): the file's 4.5 bits a weight.
//   Q5_K record (1408 bytes per 8 rows x 256 columns, from block_q5_K): the Q4_K record's 128 bytes of d, dmin, sc
//     and m, then per block k at 128 + 160k the Q5 record's qs[4][8][4] and qh[8][4] (w = d sc u - dmin m): the
//     file's 5.5 bits a weight.
//   IQ4_XS record (1088 bytes per 8 rows x 256 columns, from block_iq4_xs): fp16 d[8], the 6-bit scales ls[k][r] of
//     block k of row r (sc = ls - 32; iq4xs_scales unpacks them): at 16 + 8k + r (k < 4) the low 4 bits of ls[k][r]
//     | those of ls[k + 4][r] << 4, at 48 + 8t + r (t < 2) the top 2 bits of ls[t][r], ls[t + 2][r], ls[t + 4][r],
//     ls[t + 6][r] at bits 0, 2, 4, 6; then per block k at 64 + 128k the IQ4 record's qs[4][8][4]
//     (w = d sc kIQ4Values[nibble]): the file's 4.25 bits a weight.
//   Mixed weight (a stacked matrix whose parts have different types, e.g. a Q4_K_M file's Q4_K q, k and
//     Q6_K v): uint8 [bytes], a 64-byte header of int64 {S (1-3), nb, (weight_type, groups) x S}, then each
//     segment's [groups, nb, record] records in order; every segment but the last fills whole groups.
// So one 32-byte load holds 4 columns of 8 rows, and maddubs against a broadcast of 4
// activation bytes yields the 8 rows' partial dot products in 8 lanes: no horizontal sums.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvgen {

constexpr int64_t kBlock = 32;        // values per quantization block
constexpr int64_t kRows = 8;          // rows per interleaved group
constexpr int64_t kQ4Record = 160;    // bytes per (group, block), Q4
constexpr int64_t kQ8Record = 272;    // bytes per (group, block), Q8
constexpr int64_t kF16Record = 512;   // bytes per (group, block), F16 and BF16
constexpr int64_t kQ6Record = 1680;   // bytes per (group, super-block of 8 blocks), Q6
constexpr int64_t kQ6Block = 208;     // bytes from one 32-column block of a Q6 record to the next
constexpr int64_t kQ5Record = 192;    // bytes per (group, block), Q5
constexpr int64_t kQ50Record = 176;   // bytes per (group, block), Q5_0
constexpr int64_t kIQ4Record = 144;   // bytes per (group, block), IQ4 (and MXFP4)
constexpr int64_t kQ40Record = 144;   // bytes per (group, block), Q4_0
constexpr int64_t kQ2Record = 672;    // bytes per (group, super-block of 8 blocks), Q2
constexpr int64_t kQ3Record = 912;    // bytes per (group, super-block of 8 blocks), Q3
constexpr int64_t kQ4KRecord = 1152;  // bytes per (group, super-block of 8 blocks), Q4_K
constexpr int64_t kQ5KRecord = 1408;  // bytes per (group, super-block of 8 blocks), Q5_K
constexpr int64_t kIQ4XSRecord = 1088;  // bytes per (group, super-block of 8 blocks), IQ4_XS
constexpr int64_t kXS16Record = 1168;  // bytes per (group, super-block of 8 blocks), XS16 (IQ2_XS, IQ2_S, IQ1_M)
constexpr int64_t kMixedHeader = 64;  // bytes before a mixed weight's segments

enum WeightType : int64_t {
  kQ4 = 0, kQ8 = 1, kF16 = 2, kBF16 = 3, kQ6 = 4, kMixed = 5, kQ5 = 6, kIQ4 = 7, kQ2 = 8, kQ3 = 9, kMXFP4 = 10,
  kQ40 = 11, kQ4K = 12, kQ5K = 13, kIQ4XS = 14, kQ50 = 15,
  // GGUF IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S and TQ1_0 / TQ2_0 recoded as IQ4_XS records (recode.cpp), each read with its
  // own table below
  kIQ3XXS = 16, kIQ3S = 17, kIQ2XXS = 18, kIQ1S = 19, kTQ = 20,
  // GGUF IQ2_XS / IQ2_S and IQ1_M (a scale per 16 values) recoded as XS16 records: fp16 d[8], int8 sc[8][2][8] (block
  // k, half h = columns 16 h .. 16 h + 15, row r at 16 + 16 k + 8 h + r), then per block k the IQ4 record's qs at
  // 144 + 128 k; w = d sc[k][h][r] table[nibble] (IQ2_XXS's table, IQ1_S's)
  kIQ2XS = 21, kIQ1M = 22
};

// The 16 values a 4-bit IQ4_NL / IQ4_XS index stands for (ggml-common.h kvalues_iq4nl).
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
// The values of an MXFP4 index, FP4 E2M1 doubled (ggml-common.h kvalues_mxfp4): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
// negatives times 2, so the block scale is 2^(e - 128) instead of 2^(e - 127).
alignas(16) constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// The levels of the types recoded as IQ4_XS records (kvgen/kernels/recode.py, padded with their first entry): the
// grid values (IQ3_XXS's halved, its d halved), with the sign in the code's top half; IQ1_S's 8 g +- 1; ternary (and
// 2, TQ2_0's code 3).
alignas(16) constexpr int8_t kIQ3XXSValues[16] = {2, 6, 10, 14, 18, 22, 26, 31, -2, -6, -10, -14, -18, -22, -26, -31};
alignas(16) constexpr int8_t kIQ3SValues[16] = {1, 3, 5, 7, 9, 11, 13, 15, -1, -3, -5, -7, -9, -11, -13, -15};
alignas(16) constexpr int8_t kIQ2XXSValues[16] = {8, 25, 43, -8, -25, -43, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8};
alignas(16) constexpr int8_t kIQ1SValues[16] = {-9, -7, -1, 1, 7, 9, -9, -9, -9, -9, -9, -9, -9, -9, -9, -9};
alignas(16) constexpr int8_t kTernaryValues[16] = {-1, 0, 1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};

// The table of an XS16 weight type, null for the others.
inline const int8_t* xs16_table(int64_t weight_type) {
  return weight_type == kIQ2XS ? kIQ2XXSValues : weight_type == kIQ1M ? kIQ1SValues : nullptr;
}

// The table of a weight type read through IQ4_XS records (kIQ4Values for IQ4_XS itself), null for the others.
inline const int8_t* xs_table(int64_t weight_type) {
  switch (weight_type) {
    case kIQ4XS: return kIQ4Values;
    case kIQ3XXS: return kIQ3XXSValues;
    case kIQ3S: return kIQ3SValues;
    case kIQ2XXS: return kIQ2XXSValues;
    case kIQ1S: return kIQ1SValues;
    case kTQ: return kTernaryValues;
    default: return nullptr;
  }
}

struct BlockQ8A {
  float d;         // scale
  float s;         // d * sum(qs)
  int8_t qs[32];   // quantized values
};
static_assert(sizeof(BlockQ8A) == 40, "BlockQ8A must be 40 bytes");

// 4 activation bytes broadcast to all 8 lanes (the maddubs partner of 4 columns x 8 rows).
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// An empty asm that takes v in a register: GCC may not reassociate the integer sums across it. Without it,
// GCC turned each tile's running sums into trees over all the products of a block, whose many live values
// spilled to the stack at MT = 4 (the prefill tiles); at MT = 1 the tree fits and is faster than the chain.
inline void keep_in_register(__m256i& v) { asm volatile("" : "+x"(v)); }

// Calls tile(std::integral_constant<int, MT>{}) for a tile of MT = mt activation rows (1, 2, 3; 4 for mt >= 4): every
// kernel's tile template is compiled once per row count and picked here, as in
//   tile_rows(mt, [&](auto MT) { q8_tile<MT>(w, a, nb, out); });
template <typename Tile>
inline void tile_rows(int mt, Tile&& tile) {
  switch (mt) {
    case 1: tile(std::integral_constant<int, 1>{}); break;
    case 2: tile(std::integral_constant<int, 2>{}); break;
    case 3: tile(std::integral_constant<int, 3>{}); break;
    default: tile(std::integral_constant<int, 4>{}); break;
  }
}

// The Q4 / Q4_0 and Q5 / Q5_0 tiles: MT activation rows against one group's nb records of kRecord bytes (fp16 d[8] at
// 0; kZeroPoint 0: fp16 m[8] at 16, else m = -kZeroPoint d, the value a record with m would store, exact: a power of
// two times an fp16). dots(w + kDotsAt, b, dot) gives dot[m], row m's int32 dot with the record at w for activation
// block b (kDotsAt: where its values start),
// then acc += dot * d_w * d_a + m_w * s_a (llama.cpp ggml_vec_dot_q4_1_q8_1 algebra), and out[m] gets the group's 8
// columns of row m. The record kPrefetchRecords ahead is prefetched line by line (enough records in flight to cover
// DRAM latency: 8 ahead left half the bandwidth unused on cold weights). Always inlined, so a VNNI tile
// (KVGEN_VNNI_BEGIN) gets the loop in its own body with its dots inlined.
template <int MT, int64_t kRecord, int64_t kPrefetchRecords, int kZeroPoint, int64_t kDotsAt, class Dots>
__attribute__((always_inline)) inline void affine_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                       float* const* out, Dots dots) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kRecord) {
    const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchRecords * kRecord;
    for (int64_t c = 0; c < kRecord; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
    __m256i dot[MT];
    dots(w + kDotsAt, b, dot);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256 mw = kZeroPoint == 0 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)))
                                      : _mm256_mul_ps(dw, _mm256_set1_ps(-static_cast<float>(kZeroPoint)));
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(dw, _mm256_set1_ps(a[m][b].d)), acc[m]);
      acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a[m][b].s), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

// A Q4_K / Q5_K record's scales and mins (layout above) as bytes: sm[8k + r] = sc[k][r], sm[64 + 8k + r] = m[k][r].
// 16-bit shifts are safe: each mask keeps only bits that came from the byte's own bits.
__attribute__((always_inline)) inline void k_scales_mins(const uint8_t* w, uint8_t* sm) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));  // blocks 0-3
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64));  // blocks 4-7
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 96));
  const auto put = [sm](int at, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(sm + at), v); };
  put(0, _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), top2)));
  put(32, _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), top2)));
  put(64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(h, top2)));
  put(96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(h, 2), top2)));
}

// An IQ4_XS record's 64 six-bit scales (the 48 bytes at its byte 16, layout above) as int8 ls - 32: sc[8k + r] for
// block k, row r. The top-bit bytes, in both lanes, serve blocks 0-1 (4-5) in the low lane and 2-3 (6-7) in the
// high one, each lane shifting its own bits to 4-5 (32-bit shifts: the mask drops the bits from other bytes).
__attribute__((always_inline)) inline void iq4xs_scales(const uint8_t* p, int8_t* sc) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32)));
  const __m256i top_lo = _mm256_sllv_epi32(h, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2));  // of blocks 0-3
  const __m256i top_hi = _mm256_srlv_epi32(h, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));  // of blocks 4-7
  const __m256i lo = _mm256_or_si256(_mm256_and_si256(l, low4), _mm256_and_si256(top_lo, top2));
  const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), low4), _mm256_and_si256(top_hi, top2));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc), _mm256_sub_epi8(lo, bias));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc + 32), _mm256_sub_epi8(hi, bias));
}

// The Q4_K and Q5_K tiles: MT activation rows against one group's super-block records of kRecord bytes (fp16 d at 0,
// dmin at 16); scales: null (each record's scales and mins unpacked here by k_scales_mins) or the group's, unpacked
// by qgemm once for all its tiles (k_scales_mins of each record: 128 bytes a record). dots(w, k, b, dot) gives block k's int32 dot
// per row; per block the rows' d sc and dmin m in fp32 (shared by the MT rows), then per row acc += dot (d sc) d_a -
// (dmin m) s_a: Q4's two fmadds and registers (accumulating d sum_k sc_k dot_k per row instead spilled at MT = 4).
// Always inlined: a VNNI tile (KVGEN_VNNI_BEGIN) that calls it with its VNNI dots gets the loop in its own body, where
// the dots inline too (a function compiled for fewer extensions cannot inline them: a call per block).
template <int MT, int64_t kRecord, int64_t kPrefetchRecords, bool kUnpack, class Dots>
__attribute__((always_inline)) inline void k_quant_tile_body(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                             float* const* out, const uint8_t* scales, Dots dots) {
  constexpr int64_t kStep = kRecord / 8;  // prefetch a record ahead in 8 steps
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  alignas(32) uint8_t unpacked[kUnpack ? 128 : 1];
  for (int64_t sb = 0; sb < nb / 8; ++sb, w += kRecord) {
    const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchRecords * kRecord;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
    const uint8_t* sm = kUnpack ? unpacked : scales + 128 * sb;
    if constexpr (kUnpack) k_scales_mins(w, unpacked);
    for (int k = 0; k < 8; ++k) {
      const int64_t b = 8 * sb + k;
      for (int64_t c = 0; c < kStep; c += 64) _mm_prefetch(ahead + kStep * k + c, _MM_HINT_T0);
      __m256i dot[MT];
      dots(w, k, b, dot);
      const __m256 scale = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8 * k)))));
      const __m256 mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 64 + 8 * k)))));
      for (int m = 0; m < MT; ++m) {
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(scale, _mm256_set1_ps(a[m][b].d)), acc[m]);
        acc[m] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(a[m][b].s), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

// scales null: each record's scales unpacked in the loop, from the record just read (a group met by one tile, as in
// decode: unpacked ahead by qgemm, the records' scattered first lines were read before their prefetches, and qgemm
// 5632 x 2048 at M = 1 ran 1.2-1.4x slower); else the group's, unpacked once for its several tiles (in the loop, that
// took Q4_K at M = 64 1.03x as long, in cache).
template <int MT, int64_t kRecord, int64_t kPrefetchRecords, class Dots>
__attribute__((always_inline)) inline void k_quant_tile(const uint8_t* w, const BlockQ8A* const* a, int64_t nb,
                                                        float* const* out, const uint8_t* scales, Dots dots) {
  if (scales == nullptr) return k_quant_tile_body<MT, kRecord, kPrefetchRecords, true>(w, a, nb, out, scales, dots);
  k_quant_tile_body<MT, kRecord, kPrefetchRecords, false>(w, a, nb, out, scales, dots);
}

// AVX512-VNNI with AVX512VL (Ice Lake and later Xeons, AMD Zen 4 and later): vpdpbusd sums 4 u8 x s8 products
// into each int32 lane in one instruction, where AVX2 needs maddubs (pairs into int16), an int16 add and a madd with
// ones (pairs into int32). Every quantized kernel has VNNI dots for it: its tile loop is one (Q2_K / Q3_K: two)
// always-inlined template over a dots functor, instantiated once with the AVX2 dots and once, between
// KVGEN_VNNI_BEGIN and KVGEN_VNNI_END (compiled for these extensions; the rest of the library stays AVX2), with the
// VNNI dots. use_vnni() picks per call: the CPU has AVX512F, BW, VL and VNNI, and $KVGEN_KERNELS_ISA is not "avx2".
// The int32 sums equal the AVX2 path's (no int16 sum there saturates), so the outputs are bit-identical.
#define KVGEN_VNNI_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512vnni\")")
#define KVGEN_VNNI_END _Pragma("GCC pop_options")
bool use_vnni();

// Loads for the pair tiles, which take two consecutive 8-row groups in 512-bit registers (affine_pair_tile below).
KVGEN_VNNI_BEGIN
// 32 bytes of each of two groups' records in one 512-bit register (lanes 0-7: group 0's rows, 8-15: group 1's).
inline __m512i pair_bytes(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}

// 8 fp16 of each of two groups' records as 16 floats.
inline __m512 pair_halves(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1));
}

// Bytes [offset, offset + bytes) past w0 and past w1, a prefetch a line: the two weight streams of a pair tile, each
// as far ahead as its one-group tile reads.
inline void prefetch_pair(const uint8_t* w0, const uint8_t* w1, int64_t offset, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w0) + offset + c, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1) + offset + c, _MM_HINT_T0);
  }
}

// 8 bytes of each of two groups' unpacked scales (or mins) as 16 floats.
inline __m512 pair_bytes_ps(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)))));
}

KVGEN_VNNI_END
// Activation rows of one VNNI tile call (every group function takes up to this many there, F16 / BF16 too; on AVX2
// up to 4): AVX-512VL's 32 registers hold 8 rows' sums, and
// each weight vector unpacked serves twice the rows. qgemm 3072 x 768 (2 threads, in-process A/B, M = 16-512): Q4_1
// 394-437 -> 477-482 GOPS at M = 512 (a 512-token prefill +2-6 %); Q4_K 1.02-1.19x, Q5_K 1.08-1.18x,
// Q6_K 1.08-1.16x, Q5_0 / Q5_1 1.04-1.20x, IQ4_NL and IQ4_XS 1.02-1.18x (one noisy run of IQ4_NL: 0.96-1.05x).
constexpr int kVnniRows = 8;

// Calls tile(std::integral_constant<int, MT>{}, r) to cover mt <= kVnniRows activation rows with VNNI tiles of MT
// rows from row r: all 8 in one tile, 5-7 as 4 and the rest, fewer in one (tile_rows), as in
//   vnni_tile_rows(mt, [&](auto MT, int r) { q4k_tile_vnni<MT>(w, a + r, nb, out + r); });
template <typename Tile>
inline void vnni_tile_rows(int mt, Tile&& tile) {
  static_assert(kVnniRows == 8, "8 rows: one tile; 5-7: 4 and the rest");
  if (mt == 8) return tile(std::integral_constant<int, 8>{}, 0);
  if (mt > 4) {
    tile(std::integral_constant<int, 4>{}, 0);
    return tile_rows(mt - 4, [&](auto MT) { tile(MT, 4); });
  }
  tile_rows(mt, [&](auto MT) { tile(MT, 0); });
}

KVGEN_VNNI_BEGIN
// The pair tiles: two consecutive 8-row groups (w0, w1) against kVnniRows activation rows in 512-bit registers, lanes
// 0-7 holding group 0's rows and 8-15 group 1's, so each activation broadcast serves 16 weight rows (half the
// broadcasts of two 8-row tiles, which held those back: Q4_1 qgemm 476-522 -> 548-616 GOPS at M = 8-256). Lane by lane
// they run the one-group tiles' operations in their order (exact int32 dots, then the same fmadds): the same bits.
// affine_pair_tile is affine_tile's loop (the Q4 / Q4_0 / Q5 / Q5_0 records); dots(qs0, qs1, b, dot) gives each
// row's int32 dots of both groups for activation block b.
template <int64_t kRecord, int64_t kPrefetchRecords, int kZeroPoint, int64_t kDotsAt, class Dots>
__attribute__((always_inline)) inline void affine_pair_tile(const uint8_t* w0, const uint8_t* w1,
                                                            const BlockQ8A* const* a, int64_t nb, float* const* out,
                                                            Dots dots) {
  __m512 acc[kVnniRows];
  for (int m = 0; m < kVnniRows; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w0 += kRecord, w1 += kRecord) {
    prefetch_pair(w0, w1, kPrefetchRecords * kRecord, kRecord);
    __m512i dot[kVnniRows];
    dots(w0 + kDotsAt, w1 + kDotsAt, b, dot);
    const __m512 dw = pair_halves(w0, w1);
    const __m512 mw = kZeroPoint == 0 ? pair_halves(w0 + 16, w1 + 16)
                                      : _mm512_mul_ps(dw, _mm512_set1_ps(-static_cast<float>(kZeroPoint)));
    for (int m = 0; m < kVnniRows; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(dw, _mm512_set1_ps(a[m][b].d)), acc[m]);
      acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[m][b].s), acc[m]);
    }
  }
  for (int m = 0; m < kVnniRows; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

// k_quant_tile_body's loop for two Q4_K / Q5_K groups; s0, s1: their scales unpacked by qgemm (128 bytes a record), or
// null: each record's unpacked in the loop, from the records just read (as k_quant_tile: at M = 8, cold, unpacking
// ahead made Q4_K 0.89x as fast); dots(r0, r1, k, b, dot) gives each row's int32 dots of block k of both records.
template <int64_t kRecord, int64_t kPrefetchRecords, class Dots>
__attribute__((always_inline)) inline void k_quant_pair_tile(const uint8_t* w0, const uint8_t* w1,
                                                             const BlockQ8A* const* a, int64_t nb, float* const* out,
                                                             const uint8_t* s0, const uint8_t* s1, Dots dots) {
  constexpr int64_t kStep = kRecord / 8;
  const bool unpack = s0 == nullptr;
  alignas(32) uint8_t unpacked[2][128];
  __m512 acc[kVnniRows];
  for (int m = 0; m < kVnniRows; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb, w0 += kRecord, w1 += kRecord) {
    const __m512 dw = pair_halves(w0, w1), dmin = pair_halves(w0 + 16, w1 + 16);
    if (unpack) {
      k_scales_mins(w0, unpacked[0]);
      k_scales_mins(w1, unpacked[1]);
    }
    const uint8_t* sm0 = unpack ? unpacked[0] : s0 + 128 * sb;
    const uint8_t* sm1 = unpack ? unpacked[1] : s1 + 128 * sb;
    for (int k = 0; k < 8; ++k) {
      const int64_t b = 8 * sb + k;
      prefetch_pair(w0, w1, kPrefetchRecords * kRecord + kStep * k, kStep);  // a record ahead in 8 steps
      __m512i dot[kVnniRows];
      dots(w0, w1, k, b, dot);
      const __m512 scale = _mm512_mul_ps(dw, pair_bytes_ps(sm0 + 8 * k, sm1 + 8 * k));
      const __m512 mn = _mm512_mul_ps(dmin, pair_bytes_ps(sm0 + 64 + 8 * k, sm1 + 64 + 8 * k));
      for (int m = 0; m < kVnniRows; ++m) {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(scale, _mm512_set1_ps(a[m][b].d)), acc[m]);
        acc[m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a[m][b].s), acc[m]);
      }
    }
  }
  for (int m = 0; m < kVnniRows; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

// 4 activation bytes broadcast to all 16 lanes.
inline __m512i bcast4x16(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
KVGEN_VNNI_END

// Quantize one row of K floats (K % 32 == 0) into K / 32 blocks.
void quantize_row_q8a(const float* x, BlockQ8A* y, int64_t K);

// y[m, 8 rows] for MT activation rows against one 8-row group of nb blocks.
// out[m] points at 8 floats (the group's columns of output row m).
void q4_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out);
void q40_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out);
// Q4_K groups: nb a multiple of 8 (whole super-block records).
// scales: null, or the group's scales and mins unpacked by qgemm (k_scales_mins of each record; k_quant_tile).
void q4k_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out,
               const uint8_t* scales);
// Two consecutive groups w0, w1 of weight_type kQ4, kQ40 or kQ4K against mt <= kVnniRows activation rows, on a VNNI
// host: with kVnniRows rows in one pass of 512-bit registers (each activation broadcast serving both groups' 16
// rows), else each group's own tiles; the same bits either way. out[m] points at 16 floats (w0's columns, then w1's);
// scales (Q4_K): the two groups' unpacked scales back to back (nb / 8 * 128 bytes each).
// The pair tiles (affine_pair_tile above) of two consecutive groups w0, w1 against kVnniRows activation rows, on a
// VNNI host; out[m] points at 16 floats (w0's columns, then w1's). Q4 / Q5: has_min (Q4_1, Q5_1) or not (Q4_0,
// Q5_0); the K types and IQ4_XS: each group's unpacked scales; Q6 and Q3: the activation half offsets, Q2: the half
// sums, Q8 and the IQ4 types: the block sums, of its VNNI tile (XS16: the half offsets); the IQ4 types and XS16: the
// table of their indices.
void q4_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, int64_t nb, float* const* out,
                  bool has_min);
void q4k_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, int64_t nb, float* const* out,
                   const uint8_t* scales0, const uint8_t* scales1);
void q5_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, int64_t nb, float* const* out,
                  bool has_min);
void q5k_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, int64_t nb, float* const* out,
                   const uint8_t* scales0, const uint8_t* scales1);
void q6_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* offsets,
                  int64_t nb, float* const* out);
void q8_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* block_sums,
                  int64_t nb, float* const* out);
void iq4_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* block_sums,
                   int64_t nb, float* const* out, const int8_t* table);
void iq4xs_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* block_sums,
                     int64_t nb, float* const* out, const int8_t* scales0, const int8_t* scales1,
                     const int8_t* table);
void q2_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* half_sums,
                  int64_t nb, float* const* out);
void q3_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* offsets,
                  int64_t nb, float* const* out);
// F16 / BF16 (is_bf16): the activation rows x unquantized, as f16_group.
void f16_pair_tile(const uint8_t* w0, const uint8_t* w1, const float* const* x, int64_t nb, float* const* out,
                   bool is_bf16);
// Q8 groups take their VNNI tiles where block_sums is not null (see iq4_group below).
void q8_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* block_sums, int mt, int64_t nb,
              float* const* out);
void q5_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out);
void q50_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out);
void q5k_group(const uint8_t* w, const BlockQ8A* const* a, int mt, int64_t nb, float* const* out,
               const uint8_t* scales);  // nb % 8 == 0
// IQ4 and MXFP4 groups: `values` is the 16-entry table of the indices (kIQ4Values, kMXFP4Values). Q8, IQ4, MXFP4 and
// IQ4_XS groups take their VNNI tiles where block_sums is not null: block_sums[m][b] = 128 * the sum of row m's
// activation block b (activation_block_sums; qgemm passes them on AVX512-VNNI), null on AVX2.
void activation_block_sums(const BlockQ8A* a, int64_t n, int32_t* sums);
void iq4_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* block_sums, int mt, int64_t nb,
               float* const* out, const int8_t* values);
// IQ4_XS records: nb % 8 == 0; scales null, or the group's int8 scales unpacked by qgemm (iq4xs_scales, 64 bytes a
// record); table: the values of the 4-bit indices (xs_table).
void iq4xs_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* block_sums, int mt, int64_t nb,
                 float* const* out, const int8_t* scales, const int8_t* table);
// XS16 records (kIQ2XS, kIQ1M): nb % 8 == 0; the VNNI tiles where half_offsets is not null (-128 x each half's
// activation sum, activation_half_offsets; qgemm passes them on AVX512-VNNI), and the pair tile.
void xs16_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_offsets, int mt, int64_t nb,
                float* const* out, const int8_t* table);
void xs16_pair_tile(const uint8_t* w0, const uint8_t* w1, const BlockQ8A* const* a, const int32_t* const* half_offsets,
                    int64_t nb, float* const* out, const int8_t* table);
// Q6 (nb a multiple of 8: whole super-block records), Q2 and Q3 also read each activation block's two half sums (bytes 0-15 in the low, 16-31 in the high int16 of
// half_sums[m][b]), written for n blocks by activation_half_sums.
void activation_half_sums(const BlockQ8A* a, int64_t n, int32_t* sums);
// Q6 groups take their VNNI tile where offsets is not null: offsets[m][2b + h] = -32 x the sum of half h of row m's
// activation block b (activation_half_offsets with factor -32; qgemm passes them on AVX512-VNNI, half_sums on AVX2).
void activation_half_offsets(const BlockQ8A* a, int64_t n, int32_t factor, int32_t* offsets);
void q6_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_sums,
              const int32_t* const* offsets, int mt, int64_t nb, float* const* out);
// The same for Q2 and Q3 groups (nb a multiple of 8: whole super-block records), on AVX512-VNNI with VNNI tiles:
// Q2 reads half_sums there too, Q3 offsets (factor -4) instead.
void q2_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_sums, int mt, int64_t nb,
              float* const* out);
void q3_group(const uint8_t* w, const BlockQ8A* const* a, const int32_t* const* half_sums,
              const int32_t* const* offsets, int mt, int64_t nb, float* const* out);
// The same for an F16 group against MT float32 activation rows x[m] (K values each).
void f16_group(const uint8_t* w, const float* const* x, int mt, int64_t nb, float* const* out);
void bf16_group(const uint8_t* w, const float* const* x, int mt, int64_t nb, float* const* out);

}  // namespace kvgen
