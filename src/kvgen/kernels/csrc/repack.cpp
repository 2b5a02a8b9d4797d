// Repacking GGUF rows into the kernels' 8-row records (layouts in common.h), at load.
// parts: row blocks of one matrix (e.g. q, k, v), each [rows_i, nb * block bytes] uint8 of
// one GGUF type: 0 = Q4_0 (fp16 d, 16 nibble bytes), 1 = Q4_1 (fp16 d, fp16 m, 16 nibble
// bytes), 2 = Q8_0 (fp16 d, 32 int8), 3 = F16, 4 = BF16 (32 16-bit values per block). Rows are numbered across
// parts; missing rows of the last group are zero (scale 0). Source: ggml-common.h block_q4_0 /
// block_q4_1 / block_q8_0.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include <ATen/ops/zeros.h>

#include "aten_lite.h"
#include "common.h"

namespace kvgen {

at::Tensor repack_gguf(const std::vector<at::Tensor>& parts, int64_t gguf_type) {
  TORCH_CHECK(gguf_type >= 0 && gguf_type <= 4,
              "kvgen.repack_gguf: gguf_type must be 0 (Q4_0), 1 (Q4_1), 2 (Q8_0), 3 (F16) or 4 (BF16)");
  TORCH_CHECK(!parts.empty(), "kvgen.repack_gguf: no rows");
  const bool is_16bit = gguf_type >= 3;  // F16, BF16
  const int64_t src_block = gguf_type == 0 ? 18 : gguf_type == 1 ? 20 : gguf_type == 2 ? 34 : 64;
  const int64_t rec = gguf_type == 2 ? kQ8Record : is_16bit ? kF16Record : kQ4Record;
  const int64_t row_bytes = parts[0].size(1), nb = row_bytes / src_block;
  int64_t rows = 0;
  for (const auto& p : parts) {
    TORCH_CHECK(p.dtype() == at::kByte && p.dim() == 2 && p.is_contiguous() && p.size(1) == row_bytes &&
                    row_bytes % src_block == 0,
                "kvgen.repack_gguf: parts must be contiguous uint8 [rows, ", row_bytes, "] of whole blocks");
    rows += p.size(0);
  }
  const int64_t G = (rows + kRows - 1) / kRows;
  at::Tensor out = at::zeros({G, nb, rec}, parts[0].options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  int64_t n = 0;
  for (const auto& p : parts) {
    const uint8_t* src = p.data_ptr<uint8_t>();
    for (int64_t i = 0; i < p.size(0); ++i, ++n) {
      const int64_t g = n / kRows, r = n % kRows;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* s = src + i * row_bytes + b * src_block;
        uint8_t* d = dst + (g * nb + b) * rec;
        if (is_16bit) {  // column c of row r -> w[c][r]
          for (int c = 0; c < kBlock; ++c) std::memcpy(d + 16 * c + 2 * r, s + 2 * c, 2);
          continue;
        }
        std::memcpy(d + 2 * r, s, 2);  // d
        if (gguf_type == 2) {
          for (int j = 0; j < 8; ++j) std::memcpy(d + 16 + 32 * j + 4 * r, s + 2 + 4 * j, 4);
          continue;
        }
        if (gguf_type == 1) {
          std::memcpy(d + 16 + 2 * r, s + 2, 2);  // m
        } else {  // Q4_0: value = (q - 8) d = q d + m with m = -8 d, exact in fp16
          uint16_t h;
          std::memcpy(&h, s, 2);
          const uint16_t m = _cvtss_sh(-8.0f * _cvtsh_ss(h), 0);
          std::memcpy(d + 16 + 2 * r, &m, 2);
        }
        const uint8_t* qs = s + src_block - 16;
        for (int t = 0; t < 4; ++t) std::memcpy(d + 32 + 32 * t + 4 * r, qs + 4 * t, 4);
      }
    }
  }
  return out;
}

}  // namespace kvgen
