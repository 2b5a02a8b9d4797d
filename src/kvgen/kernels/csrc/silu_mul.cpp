// SwiGLU's gate (Shazeer 2020): silu(g) * u = g / (1 + exp(-g)) * u.
// gate_up: [M, 2I] float32 (gate columns first, as gate_up_proj) -> [M, I] float32.
#include "aten_lite.h"

#include <cmath>

#include "vec_math.h"

namespace kvgen {

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.dtype() == at::kFloat && gate_up_in.dim() == 2 && gate_up_in.size(1) % 16 == 0,
              "kvgen.silu_mul: float32 [M, 2I] with I % 8 == 0");
  const at::Tensor gu = gate_up_in.contiguous();
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({M, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, M, M * I < (1 << 15) ? M : 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = gp + m * 2 * I;
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp256(_mm256_xor_ps(x, sign));  // exp(-x)
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(op + m * I + i, _mm256_mul_ps(s, _mm256_loadu_ps(g + I + i)));
      }
    }
  });
  return out;
}

}  // namespace kvgen
