// Repacking GGUF rows into the kernels' 8-row records (layouts in common.h), at load.
// parts: row blocks of one matrix (e.g. q, k, v), each [rows_i, nb * block bytes] uint8 of
// one GGUF type: 0 = Q4_0 (fp16 d, 16 nibble bytes: the Q4_0 record), 1 = Q4_1 (fp16 d, fp16 m, 16 nibble
// bytes), 2 = Q8_0 (fp16 d, 32 int8), 3 = F16, 4 = BF16 (32 16-bit values per block), 5 = Q6_K (256 values
// per 210-byte block: ql[128], qh[64], int8 scales[16], fp16 d), 6 = Q5_0, 7 = Q5_1, 8 = IQ4_NL (fp16 d, 16 nibble
// bytes of indices into kIQ4Values), 9 = Q2_K, 10 = Q3_K, 11 = MXFP4 (uint8 E8M0 exponent e, 16 nibble bytes of
// indices into kMXFP4Values; exponents outside 104 .. 143 are refused), 12 = Q4_K (fp16 d, dmin, 12 bytes of 6-bit
// scales and mins, 128 nibble bytes per 256 values), 13 = Q5_K (the same with 32 bytes of high bits before the
// nibbles), 14 = IQ4_XS (fp16 d, uint16 scales_h, uint8 scales_l[4], 128 bytes of indices per 256 values), 15 = XS16
// (recode.cpp's rows of IQ2_XS, IQ2_S, IQ1_M: fp16 d, int8 scales[16] per 16 values, IQ4_XS's 128 index bytes). Rows
// are numbered across parts; missing rows of the last group are zero (scale 0). The records go into `out` where given
// (contiguous uint8 [G, nb, R], e.g. a weight arena's huge pages), else into a new tensor. Source: ggml-common.h block_q4_0 / block_q4_1 / block_q8_0 /
// block_q6_K / block_iq4_nl / block_mxfp4 / block_q4_K / block_q5_K, ggml-quants.c dequantize_row_q6_K /
// dequantize_row_mxfp4 / dequantize_row_q4_K / dequantize_row_q5_K / dequantize_row_iq4_xs.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>


#include "aten_lite.h"
#include "common.h"

namespace kvgen {
namespace {

constexpr int64_t kQ6KBlock = 210;  // bytes per 256 values (block_q6_K)

// The records keep a row's 4-column runs 32 bytes apart: bytes 4t .. 4t + 3 of v go to d + 32 t (t = 0 .. 3).
inline void store_runs(uint8_t* d, __m128i v) {
  const uint32_t w[4] = {static_cast<uint32_t>(_mm_cvtsi128_si32(v)), static_cast<uint32_t>(_mm_extract_epi32(v, 1)),
                         static_cast<uint32_t>(_mm_extract_epi32(v, 2)), static_cast<uint32_t>(_mm_extract_epi32(v, 3))};
  for (int t = 0; t < 4; ++t) std::memcpy(d + 32 * t, &w[t], 4);
}

// Bytes (x >> shift) & mask of 16 bytes (a 16-bit shift, masked back into each byte).
inline __m128i bits(__m128i x, int shift, int mask) {
  return _mm_and_si128(_mm_srli_epi16(x, shift), _mm_set1_epi8(static_cast<char>(mask)));
}

// Byte i of the result: x[i] | x[i + 4] << step | x[i + 8] << 2 step | x[i + 12] << 3 step, for x's bytes below
// 2^step (the records' 2-bit planes, step 2, and bit planes, step 1; i = 0 .. 3).
inline __m128i gather4(__m128i x, int step) {
  __m128i y = x;
  y = _mm_or_si128(y, _mm_slli_epi16(_mm_srli_si128(x, 4), step));
  y = _mm_or_si128(y, _mm_slli_epi16(_mm_srli_si128(x, 8), 2 * step));
  return _mm_or_si128(y, _mm_slli_epi16(_mm_srli_si128(x, 12), 3 * step));
}

// One row's Q6_K super-block s (256 values) into its Q6 record d as row r: d once, each 32-column block's fields
// at kQ6Block * j (sc at 16, lo at 32, hi at 160 from there).
void repack_q6_k(const uint8_t* s, int64_t r, uint8_t* d) {
  const uint8_t* ql = s;
  const uint8_t* qh = s + 128;
  const uint8_t* sc = s + 192;
  alignas(32) uint8_t u[256];  // the 6-bit values q + 32, as dequantize_row_q6_K reads them
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  for (int n = 0; n < 2; ++n) {  // u[128 n + 32 p + l] from ql[64 n + l (+ 32)] and bits 2 p of qh[32 n + l]
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * n));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * n + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * n));
    const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                           _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
    for (int p = 0; p < 4; ++p) {
      const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * p), m3), 4);
      _mm256_store_si256(reinterpret_cast<__m256i*>(u + 128 * n + 32 * p), _mm256_or_si256(lo[p], high));
    }
  }
  std::memcpy(d + 2 * r, s + 208, 2);  // d
  for (int j = 0; j < 8; ++j, d += kQ6Block) {
    const uint8_t* c = u + 32 * j;  // this block's 32 columns
    d[16 + r] = sc[2 * j];
    d[24 + r] = sc[2 * j + 1];
    const __m128i c0 = _mm_load_si128(reinterpret_cast<const __m128i*>(c));
    const __m128i c1 = _mm_load_si128(reinterpret_cast<const __m128i*>(c + 16));
    // low nibbles: byte 4t + i of run t is c[4t + i] & 15 | (c[16 + 4t + i] & 15) << 4
    store_runs(d + 32 + 4 * r, _mm_or_si128(bits(c0, 0, 15), _mm_slli_epi16(bits(c1, 0, 15), 4)));
    // 2-bit planes: byte i of plane v is c[8v + i] >> 4 | c[16 + 8v + i] >> 4 << 2 | c[8v + 4 + i] >> 4 << 4 | ...
    const __m128i x = _mm_or_si128(bits(c0, 4, 3), _mm_slli_epi16(bits(c1, 4, 3), 2));  // 4-bit values
    const __m128i y = _mm_or_si128(x, _mm_slli_epi16(_mm_srli_si128(x, 4), 4));  // bytes 0-3: plane 0, 8-11: 1
    const uint32_t planes[2] = {static_cast<uint32_t>(_mm_cvtsi128_si32(y)), static_cast<uint32_t>(_mm_extract_epi32(y, 2))};
    for (int v = 0; v < 2; ++v) std::memcpy(d + 160 + 32 * v + 4 * r, &planes[v], 4);
  }
}

// Q3_K's 16 six-bit scales s_j from its 12 packed bytes (ggml dequantize_row_q3_K's unpacking).
void q3_k_scales(const uint8_t* packed, uint8_t* scales) {
  uint32_t aux[4];
  std::memcpy(aux, packed, 12);
  const uint32_t tmp = aux[2], kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  std::memcpy(scales, aux, 16);
}

// Q3_K's values u = q + 4 hm in [0, 7] (value = d (s_j - 32) (u - 4)), value 128 n + 32 j + l from bits 2j of
// qs[32 n + l] and bit 4 n + j of hmask[l] (ggml dequantize_row_q3_K).
void q3_k_values(const uint8_t* hm, const uint8_t* qs, uint8_t* u) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hm));
  const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
  for (int n = 0; n < 2; ++n) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * n));
    for (int j = 0; j < 4; ++j) {
      const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
      const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4 * n + j), m1), 2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + 128 * n + 32 * j), _mm256_or_si256(low, high));
    }
  }
}

// One row's Q2_K (Q3_K) super-block s (256 values) into its Q2 (Q3) record d as row r (layouts in common.h).
void repack_q23_k(const uint8_t* s, int64_t r, uint8_t* d, bool q3) {
  uint8_t u[256];
  if (q3) {
    q3_k_values(s, s + 32, u);
    uint8_t scales[16];
    q3_k_scales(s + 96, scales);
    std::memcpy(d + 2 * r, s + 108, 2);  // d
    for (int g = 0; g < 16; ++g) d[16 + 8 * g + r] = static_cast<uint8_t>(static_cast<int8_t>(scales[g] - 32));
  } else {
    for (int n = 0; n < 2; ++n) {  // value 128 n + 32 j + l: bits 2j of qs[32 n + l] (ggml dequantize_row_q2_K)
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 + 32 * n));
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + 128 * n + 32 * j),
                            _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3)));
      }
    }
    std::memcpy(d + 2 * r, s + 80, 2);  // d
    std::memcpy(d + 16 + 2 * r, s + 82, 2);  // dmin
    for (int g = 0; g < 16; ++g) d[32 + 8 * g + r] = s[g];  // sc | m << 4 of columns 16 g ..
  }
  uint8_t* planes = d + (q3 ? 144 : 160);
  for (int k = 0; k < 8; ++k) {
    for (int h = 0; h < 2; ++h) {  // byte i: the low 2 bits of values 4 sh + i of these 16, sh = 0 .. 3
      const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 32 * k + 16 * h));
      const uint32_t low = static_cast<uint32_t>(_mm_cvtsi128_si32(gather4(bits(w, 0, 3), 2)));
      std::memcpy(planes + 64 * k + 32 * h + 4 * r, &low, 4);
      if (q3) {  // their third bits, at 4 h + sh of byte i
        uint32_t high = static_cast<uint32_t>(_mm_cvtsi128_si32(gather4(bits(w, 2, 1), 1))) << (4 * h), have;
        std::memcpy(&have, d + 656 + 32 * k + 4 * r, 4);
        high |= have;
        std::memcpy(d + 656 + 32 * k + 4 * r, &high, 4);
      }
    }
  }
}

// Sub-block j's 6-bit scale and min of a K-quant's 12 packed bytes q (ggml get_scale_min_k4).
inline void k_scale_min(const uint8_t* q, int j, int& sc, int& mn) {
  sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
  mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
}

// One row's Q4_K (Q5_K) super-block s (256 values) into its Q4_K (Q5_K) record d as row r (layouts in common.h):
// sub-block j's values l are the low (j even) or high (j odd) nibbles of qs[32 (j / 2) + l] (Q5_K: plus bit j of
// qh[l] as the fifth bit).
void repack_k(const uint8_t* s, int64_t r, uint8_t* d, bool five) {
  std::memcpy(d + 2 * r, s, 2);  // d
  std::memcpy(d + 16 + 2 * r, s + 2, 2);  // dmin
  for (int k = 0; k < 8; ++k) {
    int sc, mn;
    k_scale_min(s + 4, k, sc, mn);
    d[32 + 8 * k + r] = static_cast<uint8_t>((sc & 15) | (mn & 15) << 4);
    uint8_t& top = d[96 + 8 * (k % 4) + r];  // the top 2 bits of sc, sc of block k + 4, m, m of block k + 4
    top = static_cast<uint8_t>(top | (sc >> 4) << (2 * (k / 4)) | (mn >> 4) << (4 + 2 * (k / 4)));
    const uint8_t* qs = s + (five ? 48 : 16) + 32 * (k / 2);
    const int shift = 4 * (k % 2);
    uint8_t* blk = d + 128 + (five ? 160 : 128) * k;
    // byte 4t + i of run t: (qs[4t + i] >> shift) & 15 | ((qs[16 + 4t + i] >> shift) & 15) << 4
    const __m128i a = bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), shift, 15);
    const __m128i b = bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)), shift, 15);
    store_runs(blk + 4 * r, _mm_or_si128(a, _mm_slli_epi16(b, 4)));
    if (five) {  // qh[r][i]: bit t = the fifth bit of column 4t + i, bit 4 + t = that of column 16 + 4t + i
      const __m128i lo = gather4(bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)), k, 1), 1);
      const __m128i hi = gather4(bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32)), k, 1), 1);
      const uint32_t v = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_or_si128(lo, _mm_slli_epi16(hi, 4))));
      std::memcpy(blk + 128 + 4 * r, &v, 4);
    }
  }
}

// One row's IQ4_XS super-block s (256 values) into its IQ4_XS record d as row r (layout in common.h): sub-block j's
// scale ls_j = low (j even) or high (j odd) nibble of scales_l[j / 2] | bits 2j .. 2j+1 of scales_h << 4, its 16
// index bytes (byte i: values i and 16 + i) as the IQ4 record's.
void repack_iq4_xs(const uint8_t* s, int64_t r, uint8_t* d) {
  std::memcpy(d + 2 * r, s, 2);  // d
  uint16_t scales_h;
  std::memcpy(&scales_h, s + 2, 2);
  for (int k = 0; k < 8; ++k) {
    const int ls = ((s[4 + k / 2] >> (4 * (k % 2))) & 15) | (((scales_h >> (2 * k)) & 3) << 4);
    d[16 + 8 * (k % 4) + r] |= static_cast<uint8_t>((ls & 15) << (4 * (k / 4)));
    d[48 + 8 * (k % 2) + r] |= static_cast<uint8_t>((ls >> 4) << (2 * (k / 2)));
    for (int t = 0; t < 4; ++t) std::memcpy(d + 64 + 128 * k + 32 * t + 4 * r, s + 8 + 16 * k + 4 * t, 4);
  }
}

// One row's XS16 super-block s (146 bytes: fp16 d, int8 sc[16] = sub-block j's half h at 2j + h, the IQ4_XS block's
// 128 index bytes) into its XS16 record d as row r (common.h).
void repack_xs16(const uint8_t* s, int64_t r, uint8_t* d) {
  std::memcpy(d + 2 * r, s, 2);
  for (int k = 0; k < 8; ++k) {
    d[16 + 16 * k + r] = s[2 + 2 * k];
    d[24 + 16 * k + r] = s[3 + 2 * k];
    for (int t = 0; t < 4; ++t) std::memcpy(d + 144 + 128 * k + 32 * t + 4 * r, s + 18 + 16 * k + 4 * t, 4);
  }
}

}  // namespace

at::Tensor repack_gguf(const std::vector<at::Tensor>& parts, int64_t gguf_type, const c10::optional<at::Tensor>& out_in) {
  TORCH_CHECK(gguf_type >= 0 && gguf_type <= 15, "kvgen.repack_gguf: gguf_type must be 0 (Q4_0), 1 (Q4_1), 2 (Q8_0), "
              "3 (F16), 4 (BF16), 5 (Q6_K), 6 (Q5_0), 7 (Q5_1), 8 (IQ4_NL), 9 (Q2_K), 10 (Q3_K), 11 (MXFP4), 12 (Q4_K), "
              "13 (Q5_K), 14 (IQ4_XS) or 15 (XS16)");
  TORCH_CHECK(!parts.empty(), "kvgen.repack_gguf: no rows");
  const bool is_16bit = gguf_type == 3 || gguf_type == 4;  // F16, BF16
  const bool is_q6 = gguf_type == 5, is_q5 = gguf_type == 6 || gguf_type == 7, is_mxfp4 = gguf_type == 11;
  // MXFP4: the IQ4 record, d from the block's exponent; Q4_0: the same layout (fp16 d, 16 nibble bytes) read as q - 8
  const bool is_iq4 = gguf_type == 8 || is_mxfp4 || gguf_type == 0;
  // one record per 256 columns: Q2_K, Q3_K; Q4_K, Q5_K; IQ4_XS (and Q6_K, repacked by a loop of its own)
  const bool is_q23 = gguf_type == 9 || gguf_type == 10, is_k = gguf_type == 12 || gguf_type == 13;
  const bool is_iq4xs = gguf_type == 14, is_xs16 = gguf_type == 15;
  constexpr int64_t kSrcBlock[] = {18, 20, 34, 64, 64, kQ6KBlock, 22, 24, 18, 84, 110, 17, 144, 176, 136, 146};  // bytes
  const int64_t src_block = kSrcBlock[gguf_type];
  // Q5_0: the Q5_0 record (the Q5 record without m: nibbles at 16, high bits at 144)
  const int64_t qs_at = gguf_type == 6 ? 16 : 32, qh_at = gguf_type == 6 ? 144 : 160;
  const int64_t rec = gguf_type == 2 ? kQ8Record : is_16bit ? kF16Record : is_q6 ? kQ6Record
                      : is_q5 ? (gguf_type == 6 ? kQ50Record : kQ5Record)
                      : is_iq4 ? kIQ4Record : is_q23 ? (gguf_type == 9 ? kQ2Record : kQ3Record)
                      : is_k ? (gguf_type == 12 ? kQ4KRecord : kQ5KRecord) : is_iq4xs ? kIQ4XSRecord
                      : is_xs16 ? kXS16Record : kQ4Record;
  const int64_t row_bytes = parts[0].size(1), nb = row_bytes / src_block;  // records per row
  int64_t rows = 0;
  for (const auto& p : parts) {
    TORCH_CHECK(p.dtype() == at::kByte && p.dim() == 2 && p.is_contiguous() && p.size(1) == row_bytes &&
                    row_bytes % src_block == 0,
                "kvgen.repack_gguf: parts must be contiguous uint8 [rows, ", row_bytes, "] of whole blocks");
    rows += p.size(0);
  }
  const int64_t G = (rows + kRows - 1) / kRows;
  std::vector<const uint8_t*> row_ptr;  // row n's first byte, rows numbered across parts
  row_ptr.reserve(rows);
  for (const auto& p : parts)
    for (int64_t i = 0; i < p.size(0); ++i) row_ptr.push_back(p.data_ptr<uint8_t>() + i * row_bytes);
  at::Tensor out = out_in.has_value() && out_in->defined() ? *out_in : at::empty({G, nb, rec}, parts[0].options());
  TORCH_CHECK(out.dtype() == at::kByte && out.is_contiguous() && out.sizes().equals({G, nb, rec}),
              "kvgen.repack_gguf: out must be a contiguous uint8 [", G, ", ", nb, ", ", rec, "] tensor, got ", out.sizes());
  uint8_t* dst = out.data_ptr<uint8_t>();
  // Groups are independent: threads take whole groups, each zeroed just before its rows are written (a missing
  // row of the last group keeps scale 0; the Q3, Q4_K, Q5_K and IQ4_XS records OR bits in).
  at::parallel_for(0, G, 16, [&](int64_t g_begin, int64_t g_end) {
    std::memset(dst + g_begin * nb * rec, 0, (g_end - g_begin) * nb * rec);
    for (int64_t g = g_begin; g < g_end; ++g)
      for (int64_t r = 0; r < kRows && g * kRows + r < rows; ++r) {
        const uint8_t* src = row_ptr[g * kRows + r];
        if (is_q23 || is_k || is_iq4xs || is_xs16) {  // one record per super-block
          for (int64_t sb = 0; sb < nb; ++sb) {
            uint8_t* d = dst + (g * nb + sb) * rec;
            if (is_xs16) {
              repack_xs16(src + sb * src_block, r, d);
            } else if (is_iq4xs) {
              repack_iq4_xs(src + sb * src_block, r, d);
            } else if (is_k) {
              repack_k(src + sb * src_block, r, d, gguf_type == 13);
            } else {
              repack_q23_k(src + sb * src_block, r, d, gguf_type == 10);
            }
          }
          continue;
        }
        if (is_q6) {  // one record per super-block
          for (int64_t sb = 0; sb < nb; ++sb) repack_q6_k(src + sb * kQ6KBlock, r, dst + (g * nb + sb) * rec);
          continue;
        }
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* s = src + b * src_block;
          uint8_t* d = dst + (g * nb + b) * rec;
          if (is_16bit) {  // column c of row r -> w[c][r]
            for (int c = 0; c < kBlock; ++c) std::memcpy(d + 16 * c + 2 * r, s + 2 * c, 2);
            continue;
          }
          if (is_mxfp4) {  // d = 2^(e - 128): the kMXFP4Values are twice FP4's values
            TORCH_CHECK(s[0] >= 104 && s[0] <= 143, "kvgen.repack_gguf: MXFP4 exponent ", int(s[0]),
                        " gives a scale outside float16 (104 .. 143)");
            // 2^(e - 128) as fp16 bits: normal from e = 114 (exponent field e - 113), subnormal (2^(e - 104) units
            // of 2^-24) below
            const uint16_t h = s[0] >= 114 ? static_cast<uint16_t>((s[0] - 113) << 10)
                                           : static_cast<uint16_t>(1u << (s[0] - 104));
            std::memcpy(d + 2 * r, &h, 2);
          } else {
            std::memcpy(d + 2 * r, s, 2);  // d
          }
          if (gguf_type == 2) {  // Q8_0: 8 x 4 int8 values q, stored as q + 128 (q ^ 0x80)
            for (int j = 0; j < 8; ++j)
              for (int i = 0; i < 4; ++i) d[16 + 32 * j + 4 * r + i] = s[2 + 4 * j + i] ^ 0x80;
            continue;
          }
          if (is_iq4) {  // Q4_0, IQ4_NL, MXFP4: 4 x 4 bytes of two nibbles
            const int64_t qs = is_mxfp4 ? 1 : 2;  // the values follow the scale
            for (int j = 0; j < 4; ++j) std::memcpy(d + 16 + 32 * j + 4 * r, s + qs + 4 * j, 4);
            continue;
          }
          if (gguf_type == 1 || gguf_type == 7) std::memcpy(d + 16 + 2 * r, s + 2, 2);  // m (Q5_0's: -16 d, computed)
          const uint8_t* qs = s + src_block - 16;
          for (int t = 0; t < 4; ++t) std::memcpy(d + qs_at + 32 * t + 4 * r, qs + 4 * t, 4);
          if (is_q5) {  // the 32 high bits (bit j: value j) before the nibbles, as qh[r][i] (see common.h)
            uint32_t bits;
            std::memcpy(&bits, s + src_block - 20, 4);
            for (int i = 0; i < 4; ++i) {
              uint8_t v = 0;
              for (int t = 0; t < 4; ++t) v |= ((bits >> (4 * t + i)) & 1) << t | ((bits >> (16 + 4 * t + i)) & 1) << (4 + t);
              d[qh_at + 4 * r + i] = v;
            }
          }
        }
      }
  });
  return out;
}

}  // namespace kvgen
