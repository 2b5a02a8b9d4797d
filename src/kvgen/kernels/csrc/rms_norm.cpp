// RMSNorm (Zhang & Sennrich 2019) as HF LlamaRMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)).
//   rms_norm:        x: [M, C] float32 (C % 8 == 0), w: [C] float32 -> [M, C] float32.
//   rms_norm_heads_: in place on the q and k heads of stacked rows qkv [N, (H + 2 Hkv) D] float32
//                    (D % 8 == 0): each of the H query heads by q_weight [D], each of the Hkv key heads
//                    by k_weight [D]; v is left alone (Qwen3's q_norm and k_norm, transformers Qwen3Attention).
#include "aten_lite.h"
#include "team.h"

#include <cmath>

#include "vec_math.h"

namespace kvgen {
namespace {

// y[0 .. C) = w * x * rsqrt(mean(x^2) + eps); y may be x (each value is read before it is written).
inline void norm_row(const float* x, const float* w, float* y, int64_t C, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const __m256 vr = _mm256_set1_ps(1.0f / std::sqrt(hsum(acc) / static_cast<float>(C) + eps));
  for (int64_t c = 0; c < C; c += 8) {
    _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_loadu_ps(w + c), _mm256_mul_ps(_mm256_loadu_ps(x + c), vr)));
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.dtype() == at::kFloat && w_in.dtype() == at::kFloat && x_in.dim() == 2,
              "kvgen.rms_norm: float32 [M, C]");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();  // a strided weight (a view) read as its values
  const int64_t M = x.size(0), C = x.size(1);
  TORCH_CHECK(w.numel() == C && C % 8 == 0, "kvgen.rms_norm: weight must be [C] with C % 8 == 0");
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, M, M * C < (1 << 15) ? M : 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) norm_row(xp + m * C, wp, op + m * C, C, static_cast<float>(eps));
  });
  return out;
}

void rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
                     int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dtype() == at::kFloat && qkv.dim() == 2 && qkv.is_contiguous(),
              "kvgen.rms_norm_heads_: qkv float32 [N, W] contiguous");
  TORCH_CHECK(q_weight.dtype() == at::kFloat && k_weight.dtype() == at::kFloat && q_weight.is_contiguous() &&
                  k_weight.is_contiguous(), "kvgen.rms_norm_heads_: weights float32 [D] contiguous");
  TORCH_CHECK(num_heads >= 0 && num_kv_heads >= 0, "kvgen.rms_norm_heads_: num_heads and num_kv_heads must be >= 0, ",
              "got ", num_heads, " and ", num_kv_heads);  // a negative count would walk past the row
  const int64_t N = qkv.size(0), W = qkv.size(1), D = q_weight.numel();
  TORCH_CHECK(k_weight.numel() == D && D % 8 == 0 && W == (num_heads + 2 * num_kv_heads) * D,
              "kvgen.rms_norm_heads_: width ", W, " != (H + 2 Hkv) * D with D = ", D, " (D % 8 == 0)");
  float* xp = qkv.data_ptr<float>();
  const float* qw = q_weight.data_ptr<float>();
  const float* kw = k_weight.data_ptr<float>();
  parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* head = xp + n * W + h * D;
        norm_row(head, h < num_heads ? qw : kw, head, D, static_cast<float>(eps));
      }
    }
  });
}

}  // namespace kvgen
