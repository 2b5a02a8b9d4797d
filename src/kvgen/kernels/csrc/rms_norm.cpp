// RMSNorm (Zhang & Sennrich 2019) as HF LlamaRMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)).
// x: [M, C] float32 (C % 8 == 0), w: [C] float32 -> [M, C] float32.
#include "aten_lite.h"

#include <cmath>

#include "vec_math.h"

namespace kvgen {

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  TORCH_CHECK(x_in.dtype() == at::kFloat && w.dtype() == at::kFloat && x_in.dim() == 2, "kvgen.rms_norm: float32 [M, C]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), C = x.size(1);
  TORCH_CHECK(w.numel() == C && C % 8 == 0, "kvgen.rms_norm: weight must be [C] with C % 8 == 0");
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, M * C < (1 << 15) ? M : 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = xp + m * C;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < C; c += 8) {
        const __m256 v = _mm256_loadu_ps(xr + c);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      const float r = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(C) + static_cast<float>(eps));
      const __m256 vr = _mm256_set1_ps(r);
      for (int64_t c = 0; c < C; c += 8) {
        const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(wp + c), _mm256_mul_ps(_mm256_loadu_ps(xr + c), vr));
        _mm256_storeu_ps(op + m * C + c, y);
      }
    }
  });
  return out;
}

}  // namespace kvgen
