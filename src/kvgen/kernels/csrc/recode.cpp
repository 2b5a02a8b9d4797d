// GGUF's lattice and ternary types re-encoded at load as IQ4_XS blocks over a table of their own, or, for the types
// with a scale per 16 values, as XS16 rows (the mapping and its tables: kvgen/kernels/recode.py, whose numpy twin over
// the gguf package's dequantization is this op's spec).
// raw: [N, nsb * block bytes] uint8 rows of one type, by its ggml type number: 16 = IQ2_XXS (fp16 d, per 32 values
// a uint32 of 4 grid indices and a uint32 of 4 x 7-bit sign indices + a 4-bit scale), 17 = IQ2_XS (fp16 d, per 8
// values a uint16 of a 9-bit index and a 7-bit sign index, 4-bit scales per 16), 18 = IQ3_XXS (fp16 d, 64 grid
// indices, then per 32 values a uint32 of 4 x 7-bit sign indices + a 4-bit scale), 19 = IQ1_S (fp16 d, 32 low index
// bytes, per 32 values a uint16 of 4 x 3 high index bits, a 3-bit scale and the delta's sign), 21 = IQ3_S (fp16 d,
// 64 low index bytes, 8 bytes of ninth bits, 32 bytes of sign bits, 4 bytes of 4-bit scales), 22 = IQ2_S (fp16 d, 32
// low index bytes, 32 sign bytes, 8 bytes of 2 high bits each, 4-bit scales per 16), 29 = IQ1_M (32 low index bytes,
// 16 bytes of 3 high bits + the delta's sign per 8 values, 4 uint16 of 3-bit scales per 16 under d's nibbles), 34 =
// TQ1_0 (48 + 4 bytes of five or four base-3 digits, fp16 d), 35 = TQ2_0 (64 bytes of 2-bit values, fp16 d). grid:
// uint8 [entries, 4 or 8], each grid point's values as their level's index (recode.py grid_codes; empty for TQ).
// A 7-bit sign index i stands for the 8 signs i | parity(i) << 7 (an even count of minus signs).
// Returns IQ4_XS rows [N, nsb * 136] (fp16 d / divisor, uint16 scales_h, scales_l[4], qs[128]), or for 17, 22, 29
// XS16 rows [N, nsb * 146] (fp16 d / 8, int8 sc[16], the same qs[128]).
// Source: ggml-quants.c dequantize_row_iq2_xxs / _iq2_xs / _iq3_xxs / _iq1_s / _iq3_s / _iq2_s / _iq1_m / _tq1_0 /
// _tq2_0, block_iq4_xs.
#include <immintrin.h>

#include <cstring>

#include "aten_lite.h"
#include "ops.h"

namespace kvgen {
namespace {

struct Kind {
  int64_t block_bytes, d_offset, divisor, num_levels;  // num_levels: codes of negative values start there (0: none)
  int64_t grid_entries;  // 0: no grid (ternary)
  bool halves;  // a scale per 16 values: XS16 rows out (d_offset -1: IQ1_M's d, spread over its scales' top nibbles)
};

Kind kind_of(int64_t ggml_type) {
  switch (ggml_type) {
    case 16: return {66, 0, 8, 3, 256, false};
    case 17: return {74, 0, 8, 3, 512, true};
    case 18: return {98, 0, 2, 8, 256, false};
    case 19: return {50, 0, 8, 0, 2048, false};
    case 21: return {110, 0, 1, 8, 512, false};
    case 22: return {82, 0, 8, 3, 1024, true};
    case 29: return {56, -1, 8, 0, 2048, true};
    case 34: return {54, 52, 1, 0, 0, false};
    case 35: return {66, 64, 1, 0, 0, false};
    default: TORCH_CHECK(false, "kvgen.recode_gguf: ggml_type must be 16 (IQ2_XXS), 17 (IQ2_XS), 18 (IQ3_XXS), "
                         "19 (IQ1_S), 21 (IQ3_S), 22 (IQ2_S), 29 (IQ1_M), 34 (TQ1_0) or 35 (TQ2_0), got ", ggml_type);
  }
  return {};
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The 8 signs (bit m: value m negative) of a 7-bit sign index: its bits and their parity.
inline int signs_of(uint32_t i) { return static_cast<int>(i | ((__builtin_popcount(i) & 1) << 7)); }

// Byte i of the result: 0xFF where bit i of `bits` is set, else 0.
inline __m256i bit_bytes(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  // byte i: byte i / 8 of bits
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));  // then its bit i % 8
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
}

// The 32 level codes of 8 grid points of 4 values (idx: their indices, 32-bit lanes) or 4 of 8 (64-bit lanes).
inline __m256i grid4(const uint8_t* grid, __m256i idx) {
  return _mm256_i32gather_epi32(reinterpret_cast<const int*>(grid), idx, 4);
}
inline __m256i grid8(const uint8_t* grid, __m128i idx) {
  return _mm256_i32gather_epi64(reinterpret_cast<const long long*>(grid), idx, 8);
}

// The four sign bytes of a uint32 of 4 x 7-bit sign indices, value v's sign at bit v.
inline uint32_t sign_bits(uint32_t aux) {
  uint32_t bits = 0;
  for (int k = 0; k < 4; ++k) bits |= static_cast<uint32_t>(signs_of((aux >> (7 * k)) & 127)) << (8 * k);
  return bits;
}

// Sub-block j (32 values) of super-block b: its codes (table indices, values 0-31 in bytes 0-31) and sc = 1 + 2 s.
__m256i sub_block_codes(int64_t ggml_type, const uint8_t* b, int j, const uint8_t* grid, int num_levels, int& sc) {
  const __m256i negative = _mm256_set1_epi8(static_cast<char>(num_levels));
  switch (ggml_type) {
    case 16: {  // IQ2_XXS: 4 grid points of 8 values, their indices the bytes of a uint32
      const uint32_t idx = load_u32(b + 2 + 8 * j), aux = load_u32(b + 6 + 8 * j);
      sc = 1 + 2 * static_cast<int>(aux >> 28);
      const __m256i g = grid8(grid, _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(idx))));
      return _mm256_add_epi8(g, _mm256_and_si256(bit_bytes(sign_bits(aux)), negative));
    }
    case 18: {  // IQ3_XXS: 8 grid points of 4 values, a sign byte per two
      const uint32_t aux = load_u32(b + 66 + 4 * j);
      sc = 1 + 2 * static_cast<int>(aux >> 28);
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j)));
      return _mm256_add_epi8(grid4(grid, idx), _mm256_and_si256(bit_bytes(sign_bits(aux)), negative));
    }
    case 19: {  // IQ1_S: 4 grid points of 8 values in {-1, 0, 1} (codes 0, 1, 2), level 8 g +- 1: code 2 g' + up
      const uint16_t h = load_u16(b + 34 + 2 * j);
      sc = 1 + 2 * ((h >> 12) & 7);
      const __m128i low = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(load_u32(b + 2 + 4 * j))));
      const __m128i high = _mm_slli_epi32(
          _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(h), _mm_setr_epi32(0, 3, 6, 9)), _mm_set1_epi32(7)), 8);
      const __m256i g = grid8(grid, _mm_or_si128(low, high));
      return _mm256_add_epi8(_mm256_add_epi8(g, g), _mm256_set1_epi8((h & 0x8000) ? 0 : 1));  // delta +1/8: up
    }
    default: {  // 21, IQ3_S: 8 grid points of 4 values (ninth index bits in a byte), a sign bit per value
      sc = 1 + 2 * ((b[106 + j / 2] >> (4 * (j % 2))) & 15);
      const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j)));
      const __m256i high = _mm256_slli_epi32(_mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(b[66 + j]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_set1_epi32(1)), 8);
      const __m256i g = grid4(grid, _mm256_or_si256(low, high));
      return _mm256_add_epi8(g, _mm256_and_si256(bit_bytes(load_u32(b + 74 + 4 * j)), negative));
    }
  }
}

// Sub-block j of an IQ2_XS (17), IQ2_S (22) or IQ1_M (29) super-block: its codes, and sc, sc_hi = 1 + 2 s of values
// 0-15 and 16-31 (4 grid points of 8 values: 0-1 under sc, 2-3 under sc_hi).
__m256i halves_codes(int64_t ggml_type, const uint8_t* b, int j, const uint8_t* grid, int& sc, int& sc_hi) {
  const __m256i negative = _mm256_set1_epi8(3);  // IQ2_XXS's table: +8, 25, 43, then their negatives
  if (ggml_type == 29) {  // IQ1_M: 3-bit scales 4 to a uint16; per grid point 3 high index bits and the delta's sign
    const uint16_t s = load_u16(b + 48 + 2 * (j / 2));
    sc = 1 + 2 * ((s >> (6 * (j % 2))) & 7);
    sc_hi = 1 + 2 * ((s >> (6 * (j % 2) + 3)) & 7);
    const int h[4] = {b[32 + 2 * j] & 15, b[32 + 2 * j] >> 4, b[33 + 2 * j] & 15, b[33 + 2 * j] >> 4};
    const __m128i idx = _mm_setr_epi32(b[4 * j] | (h[0] & 7) << 8, b[4 * j + 1] | (h[1] & 7) << 8,
                                       b[4 * j + 2] | (h[2] & 7) << 8, b[4 * j + 3] | (h[3] & 7) << 8);
    const __m256i g = grid8(grid, idx);
    const __m256i up = _mm256_setr_epi64x(h[0] & 8 ? 0 : 0x0101010101010101LL, h[1] & 8 ? 0 : 0x0101010101010101LL,
                                          h[2] & 8 ? 0 : 0x0101010101010101LL, h[3] & 8 ? 0 : 0x0101010101010101LL);
    return _mm256_add_epi8(_mm256_add_epi8(g, g), up);  // code 2 g' + up: 8 g + 1 or 8 g - 1 (IQ1_S's table)
  }
  const uint8_t scales = b[(ggml_type == 17 ? 66 : 74) + j];
  sc = 1 + 2 * (scales & 15);
  sc_hi = 1 + 2 * (scales >> 4);
  if (ggml_type == 17) {  // IQ2_XS: per grid point a uint16 of a 9-bit index and a 7-bit sign index
    const __m128i q = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j)));
    uint32_t bits = 0;
    for (int l = 0; l < 4; ++l) bits |= static_cast<uint32_t>(signs_of(load_u16(b + 2 + 8 * j + 2 * l) >> 9)) << (8 * l);
    const __m256i g = grid8(grid, _mm_and_si128(q, _mm_set1_epi32(511)));
    return _mm256_add_epi8(g, _mm256_and_si256(bit_bytes(bits), negative));
  }
  // IQ2_S: low index bytes, then a sign byte per grid point, then 2 high index bits per grid point
  const __m128i low = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(load_u32(b + 2 + 4 * j))));
  const __m128i high = _mm_slli_epi32(
      _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(b[66 + j]), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi32(3)), 8);
  const __m256i g = grid8(grid, _mm_or_si128(low, high));
  return _mm256_add_epi8(g, _mm256_and_si256(bit_bytes(load_u32(b + 34 + 4 * j)), negative));
}

// IQ1_M's fp16 d: the top nibbles of its 4 uint16 scales, lowest first.
inline uint16_t iq1m_d(const uint8_t* b) {
  uint16_t d = 0;
  for (int k = 0; k < 4; ++k) d |= static_cast<uint16_t>((load_u16(b + 48 + 2 * k) >> 12) << (4 * k));
  return d;
}

// The 256 codes of a TQ1_0 (34) or TQ2_0 (35) super-block: the digit itself (table -1, 0, 1, 2).
void ternary_codes(int64_t ggml_type, const uint8_t* b, uint8_t* codes) {
  if (ggml_type == 35) {  // TQ2_0: value 128 c + 32 s + i is bits 2 s of byte 32 c + i (code 3, never written: 2)
    for (int v = 0; v < 256; ++v) codes[v] = static_cast<uint8_t>((b[32 * (v / 128) + v % 32] >> (2 * ((v / 32) % 4))) & 3);
    return;
  }
  static constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};  // TQ1_0: digit k of a byte x is ((x 3^k mod 256) 3) >> 8
  for (int v = 0; v < 256; ++v) {
    const int byte = v < 160 ? v % 32 : v < 240 ? 32 + (v - 160) % 16 : 48 + (v - 240) % 4;
    const int k = v < 160 ? v / 32 : v < 240 ? (v - 160) / 16 : (v - 240) / 4;
    const uint8_t x = static_cast<uint8_t>(b[byte] * kPow3[k]);
    codes[v] = static_cast<uint8_t>((static_cast<uint16_t>(x) * 3) >> 8);
  }
}

}  // namespace

at::Tensor recode_gguf(const at::Tensor& raw, int64_t ggml_type, const at::Tensor& grid) {
  const Kind kind = kind_of(ggml_type);
  TORCH_CHECK(raw.dtype() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && raw.size(1) % kind.block_bytes == 0,
              "kvgen.recode_gguf: raw must be contiguous uint8 [N, nsb * ", kind.block_bytes, "]");
  const bool has_grid = kind.grid_entries > 0;
  TORCH_CHECK(!has_grid || (grid.dtype() == at::kByte && grid.dim() == 2 && grid.is_contiguous() &&
                            grid.size(0) == kind.grid_entries &&
                            grid.size(1) == (ggml_type == 18 || ggml_type == 21 ? 4 : 8)),
              "kvgen.recode_gguf: grid must be the type's contiguous uint8 [entries, values] level codes");
  const int64_t n = raw.numel() / kind.block_bytes, out_block = kind.halves ? 146 : 136;
  at::Tensor out = at::empty({raw.size(0), raw.size(1) / kind.block_bytes * out_block}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  const uint8_t* g = has_grid ? grid.data_ptr<uint8_t>() : nullptr;
  uint8_t* dst = out.data_ptr<uint8_t>();
  const bool is_ternary = !has_grid;
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    alignas(32) uint8_t codes[256];
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* b = src + i * kind.block_bytes;
      uint8_t* o = dst + i * out_block;
      const uint16_t d_bits = kind.d_offset < 0 ? iq1m_d(b) : load_u16(b + kind.d_offset);
      const float d = _cvtsh_ss(d_bits) / static_cast<float>(kind.divisor);
      const uint16_t dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
      std::memcpy(o, &dh, 2);
      if (kind.halves) {  // XS16 rows: d, int8 scales[16], the IQ4_XS block's 128 index bytes
        for (int j = 0; j < 8; ++j) {
          int sc = 1, sc_hi = 1;
          const __m256i c = halves_codes(ggml_type, b, j, g, sc, sc_hi);
          o[2 + 2 * j] = static_cast<uint8_t>(sc);
          o[3 + 2 * j] = static_cast<uint8_t>(sc_hi);
          const __m128i packed = _mm_or_si128(_mm256_castsi256_si128(c), _mm_slli_epi16(_mm256_extracti128_si256(c, 1), 4));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 18 + 16 * j), packed);
        }
        continue;
      }
      if (is_ternary) ternary_codes(ggml_type, b, codes);
      uint16_t scales_h = 0;
      for (int j = 0; j < 8; ++j) {
        int sc = 1;
        const __m256i c = is_ternary ? _mm256_load_si256(reinterpret_cast<const __m256i*>(codes + 32 * j))
                                     : sub_block_codes(ggml_type, b, j, g, static_cast<int>(kind.num_levels), sc);
        const int ls = sc + 32;  // IQ4_XS's 6-bit scale
        scales_h |= static_cast<uint16_t>(((ls >> 4) & 3) << (2 * j));
        o[4 + j / 2] = static_cast<uint8_t>(j % 2 ? o[4 + j / 2] | (ls & 15) << 4 : ls & 15);
        // values 0-15 in the low nibbles, 16-31 in the high (codes < 16: the 16-bit shift keeps them in their byte)
        const __m128i packed = _mm_or_si128(_mm256_castsi256_si128(c), _mm_slli_epi16(_mm256_extracti128_si256(c, 1), 4));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8 + 16 * j), packed);
      }
      std::memcpy(o + 2, &scales_h, 2);
    }
  });
  return out;
}

}  // namespace kvgen
