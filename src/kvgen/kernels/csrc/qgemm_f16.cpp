// F16 / BF16 (GGUF F16 or BF16 rows repacked into 8-row groups, see common.h) times float32 activations,
// unquantized. Per column c: one 16-byte load holds the 8 rows' 16-bit weights, widened to float32
// (vcvtph2ps for F16; a zero-extend and a 16-bit shift for BF16, whose bits are a float32's upper half), and
// one fmadd against the broadcast activation x[c] adds the 8 rows' products in 8 lanes: no horizontal sums.
// Each row keeps two accumulators (even and odd columns: two fmadd chains in flight), added at the end,
// so the arithmetic of a row does not depend on how many rows share the call.
// On an AVX512-VNNI host (use_vnni, common.h) the same tile is compiled for AVX-512VL and takes up to 8 activation
// rows (kVnniRows): 32 registers hold their 16 accumulators, and each widened weight vector serves twice the rows.
// Same instructions per row, same bits; qgemm 3072 x 768 (2 threads, Zen 4): F16 and BF16 164 -> 180 GOPS at
// M = 64-256 (142 -> 166 at M = 8), a 512-token prefill of SmolLM2-135M from its float16 / bfloat16 checkpoint +5-11 %.
#include <immintrin.h>

#include <type_traits>

#include "common.h"

#ifndef KVGEN_F16_PREFETCH
#define KVGEN_F16_PREFETCH 8
#endif

namespace kvgen {
namespace {

inline __m256 widen(const uint8_t* p, std::false_type /* F16 */) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 widen(const uint8_t* p, std::true_type /* BF16 */) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}

template <int MT, bool IsBF16>
__attribute__((always_inline)) inline void f16_tile(const uint8_t* w, const float* const* x, int64_t nb,
                                                    float* const* out) {
  const std::integral_constant<bool, IsBF16> kind;
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
      const __m256 w0 = widen(w + 16 * c, kind);
      const __m256 w1 = widen(w + 16 * c + 16, kind);
      for (int m = 0; m < MT; ++m) {
        even[m] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xb[m] + c), even[m]);
        odd[m] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xb[m] + c + 1), odd[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out[m], _mm256_add_ps(even[m], odd[m]));
}

KVGEN_VNNI_BEGIN  // not VNNI instructions: its 32 registers
template <int MT, bool IsBF16>
void f16_tile_wide(const uint8_t* w, const float* const* x, int64_t nb, float* const* out) {
  f16_tile<MT, IsBF16>(w, x, nb, out);
}
KVGEN_VNNI_END

template <bool IsBF16>
void group(const uint8_t* w, const float* const* x, int mt, int64_t nb, float* const* out) {
  if (use_vnni()) return vnni_tile_rows(mt, [&](auto MT, int r) { f16_tile_wide<MT, IsBF16>(w, x + r, nb, out + r); });
  tile_rows(mt, [&](auto MT) { f16_tile<MT, IsBF16>(w, x, nb, out); });
}

}  // namespace

void f16_group(const uint8_t* w, const float* const* x, int mt, int64_t nb, float* const* out) {
  group<false>(w, x, mt, nb, out);
}

void bf16_group(const uint8_t* w, const float* const* x, int mt, int64_t nb, float* const* out) {
  group<true>(w, x, mt, nb, out);
}

KVGEN_VNNI_BEGIN
// The pair tile (common.h) of two F16 / BF16 groups: lane by lane the operations of f16_tile_wide<8>, each broadcast
// activation serving both groups' 16 rows.
void f16_pair_tile(const uint8_t* w0, const uint8_t* w1, const float* const* x, int64_t nb, float* const* out,
                   bool is_bf16) {
  const auto widen_pair = [is_bf16](const uint8_t* p0, const uint8_t* p1) {  // 8 values of each group as 16 floats
    if (!is_bf16) return pair_halves(p0, p1);
    const __m256i bits = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  };
  __m512 even[kVnniRows], odd[kVnniRows];
  for (int m = 0; m < kVnniRows; ++m) even[m] = odd[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w0 += kF16Record, w1 += kF16Record) {
    prefetch_pair(w0, w1, KVGEN_F16_PREFETCH * kF16Record, kF16Record);
    const float* xb[kVnniRows];
    for (int m = 0; m < kVnniRows; ++m) xb[m] = x[m] + b * kBlock;
#pragma GCC unroll 16
    for (int c = 0; c < kBlock; c += 2) {
      const __m512 v0 = widen_pair(w0 + 16 * c, w1 + 16 * c);
      const __m512 v1 = widen_pair(w0 + 16 * c + 16, w1 + 16 * c + 16);
      for (int m = 0; m < kVnniRows; ++m) {
        even[m] = _mm512_fmadd_ps(v0, _mm512_set1_ps(xb[m][c]), even[m]);
        odd[m] = _mm512_fmadd_ps(v1, _mm512_set1_ps(xb[m][c + 1]), odd[m]);
      }
    }
  }
  for (int m = 0; m < kVnniRows; ++m) _mm512_storeu_ps(out[m], _mm512_add_ps(even[m], odd[m]));
}
KVGEN_VNNI_END

}  // namespace kvgen
