// Gated linear units of the MLPs: gate_up [M, 2I] float32 (gate columns first, as gate_up_proj) -> [M, I] float32.
//   silu_mul:      SwiGLU (Shazeer 2020), silu(g) * u = g / (1 + exp(-g)) * u.
//   gelu_tanh_mul: GeGLU with GELU's tanh approximation (Hendrycks & Gimpel 2016; Gemma's gelu_pytorch_tanh),
//                  0.5 g (1 + tanh(y)) * u with y = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2 y)) * u
//                  (the same value: 1 + tanh(y) = 2 / (1 + exp(-2 y)), without tanh's cancellation near -1).
//   gpt_oss_glu:   gpt-oss's clamped GLU (transformers GptOssExperts): (clamp(u, -7, 7) + 1) * g / (1 + exp(-1.702 g))
//                  with g = min(gate, 7) (a NaN gate stays NaN, as torch.clamp leaves it).
#include "aten_lite.h"
#include "team.h"

#include <cmath>

#include "vec_math.h"

namespace kvgen {
namespace {

// g / (1 + exp(scaled(g))) * up(u) over the rows: `scaled` gives the negated argument of the sigmoid for 8 gates,
// `gate` and `up` transform the gate and up values first (identity but for gpt-oss).
struct Identity {
  __m256 operator()(__m256 x) const { return x; }
};

template <typename Scaled, typename Gate = Identity, typename Up = Identity>
at::Tensor gated(const at::Tensor& gate_up_in, const char* name, Scaled scaled, Gate gate = {}, Up up = {}) {
  TORCH_CHECK(gate_up_in.dtype() == at::kFloat && gate_up_in.dim() == 2 && gate_up_in.size(1) % 16 == 0,
              "kvgen.", name, ": float32 [M, 2I] with I % 8 == 0");
  const at::Tensor gu = gate_up_in.contiguous();
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({M, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f);
  parallel_for(0, M, M * I < (1 << 15) ? M : 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = gp + m * 2 * I;
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 x = gate(_mm256_loadu_ps(g + i));
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp256(scaled(x))));
        _mm256_storeu_ps(op + m * I + i, _mm256_mul_ps(s, up(_mm256_loadu_ps(g + I + i))));
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return gated(gate_up, "silu_mul", [&](__m256 x) { return _mm256_xor_ps(x, sign); });  // -x
}

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  const __m256 a = _mm256_set1_ps(-2.0f * 0.7978845608028654f), b = _mm256_set1_ps(-2.0f * 0.7978845608028654f * 0.044715f);
  return gated(gate_up, "gelu_tanh_mul", [&](__m256 x) {  // -2 y = x (a + b x^2)
    return _mm256_mul_ps(x, _mm256_fmadd_ps(b, _mm256_mul_ps(x, x), a));
  });
}

at::Tensor gpt_oss_glu(const at::Tensor& gate_up) {
  const __m256 limit = _mm256_set1_ps(7.0f), low = _mm256_set1_ps(-7.0f), one = _mm256_set1_ps(1.0f);
  const __m256 alpha = _mm256_set1_ps(-1.702f);
  // min / max with the input second: a NaN input comes out as NaN (as torch.clamp)
  return gated(
      gate_up, "gpt_oss_glu", [&](__m256 x) { return _mm256_mul_ps(x, alpha); },
      [&](__m256 x) { return _mm256_min_ps(limit, x); },
      [&](__m256 x) { return _mm256_add_ps(_mm256_max_ps(low, _mm256_min_ps(limit, x)), one); });
}

}  // namespace kvgen
