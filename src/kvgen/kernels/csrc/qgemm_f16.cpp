// F16 (GGUF F16 rows repacked into 8-row groups, see common.h) times float32 activations, unquantized.
// Per column c: one 16-byte load holds the 8 rows' fp16 weights, vcvtph2ps widens them, and one fmadd
// against the broadcast activation x[c] adds the 8 rows' products in 8 lanes: no horizontal sums.
// Each row keeps two accumulators (even and odd columns: two fmadd chains in flight), added at the end,
// so the arithmetic of a row does not depend on how many rows share the call.
#include <immintrin.h>

#include "common.h"

#ifndef KVGEN_F16_PREFETCH
#define KVGEN_F16_PREFETCH 8
#endif

namespace kvgen {
namespace {

template <int MT>
void f16_tile(const uint8_t* w, const float* const* x, int64_t nb, float* const* out) {
  __m256 even[MT], odd[MT];
  for (int m = 0; m < MT; ++m) even[m] = odd[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kF16Record) {
    for (int c = 0; c < kF16Record; c += 64) {  // 4 KB ahead: DRAM latency, as the Q4 / Q8 kernels
      _mm_prefetch(reinterpret_cast<const char*>(w) + KVGEN_F16_PREFETCH * kF16Record + c, _MM_HINT_T0);
    }
    const float* xb[MT];
    for (int m = 0; m < MT; ++m) xb[m] = x[m] + b * kBlock;
#pragma GCC unroll 16  // unrolled, the accumulators stay in registers (rolled, GCC stored them every column)
    for (int c = 0; c < kBlock; c += 2) {
      const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
      const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c + 16)));
      for (int m = 0; m < MT; ++m) {
        even[m] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xb[m] + c), even[m]);
        odd[m] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xb[m] + c + 1), odd[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], _mm256_add_ps(even[m], odd[m]));
}

}  // namespace

void f16_group(const uint8_t* w, const float* const* x, int mt, int64_t nb, float* const* out) {
  switch (mt) {
    case 1: f16_tile<1>(w, x, nb, out); break;
    case 2: f16_tile<2>(w, x, nb, out); break;
    case 3: f16_tile<3>(w, x, nb, out); break;
    default: f16_tile<4>(w, x, nb, out); break;
  }
}

}  // namespace kvgen
