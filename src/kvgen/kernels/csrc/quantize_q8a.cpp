// Per-32-value int8 quantization of fp32 activations (llama.cpp quantize_row_q8_1, AVX2 path:
// ggml/src/ggml-cpu/arch/x86/quants.c), with d and s kept in fp32 and round-half-even as
// _mm256_round_ps(NEAREST) does. Reference: kvgen.kernels.reference.quantize_q8a.
#include <immintrin.h>

#include <cstring>

#include "common.h"

namespace kvgen {

void quantize_row_q8a(const float* x, BlockQ8A* y, int64_t K) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / kBlock; ++b, x += kBlock) {
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    __m256 amax = _mm256_andnot_ps(sign_bit, v0);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v1));
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v2));
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v3));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float max_abs = _mm_cvtss_f32(m4);
    const float d = max_abs / 127.0f;
    const float id = max_abs != 0.0f ? 127.0f / max_abs : 0.0f;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    // packs work within 128-bit lanes; the permute restores column order
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    y[b].d = d;
    y[b].s = d * static_cast<float>(_mm_cvtsi128_si32(s4));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs), i0);
  }
}

}  // namespace kvgen
