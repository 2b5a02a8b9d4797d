// Rotary position embedding in place on the q and k heads of a stacked qkv row
// (Su et al. 2021, RoFormer; rotate-half form as HF Llama: x*cos + rotate_half(x)*sin).
// qkv: [N, (H + 2 Hkv) * D] float32 contiguous; cos, sin: [N, R] float32, R <= D even. The first
// H + Hkv heads (q, then k) are rotated in their first R dimensions (pairs i, i + R/2; the other D - R pass
// through: partial rotary, HF Phi3's apply_rotary_pos_emb); v is left alone.
#include "aten_lite.h"
#include "team.h"

#include "vec_math.h"

namespace kvgen {

void rope_qkv_(at::Tensor& qkv, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dtype() == at::kFloat && qkv.dim() == 2 && qkv.is_contiguous(), "kvgen.rope_qkv_: qkv float32 [N, W] contiguous");
  TORCH_CHECK(num_heads >= 0 && num_kv_heads >= 0, "kvgen.rope_qkv_: num_heads and num_kv_heads must be >= 0, got ",
              num_heads, " and ", num_kv_heads);  // a negative count would walk past the row
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t N = qkv.size(0), W = qkv.size(1), R = cos.size(-1), half = R / 2, heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(heads > 0 && W % heads == 0, "kvgen.rope_qkv_: width ", W, " is not (H + 2 Hkv) * D");
  const int64_t D = W / heads;
  TORCH_CHECK(cos.numel() == N * R && sin.numel() == N * R && R % 2 == 0 && R >= 2 && R <= D,
              "kvgen.rope_qkv_: cos/sin must be [N, R] with R even and <= D = ", D);
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* cr = cp + n * R;
      const float* sr = sp + n * R;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* x = xp + n * W + h * D;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
          const __m256 c1 = _mm256_loadu_ps(cr + i), s1 = _mm256_loadu_ps(sr + i);
          const __m256 c2 = _mm256_loadu_ps(cr + half + i), s2 = _mm256_loadu_ps(sr + half + i);
          _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, c1), _mm256_mul_ps(x2, s1)));
          _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, c2), _mm256_mul_ps(x1, s2)));
        }
        for (; i < half; ++i) {  // R / 2 not a multiple of 8: the same products one lane at a time
          const float x1 = x[i], x2 = x[half + i];
          x[i] = x1 * cr[i] - x2 * sr[i];
          x[half + i] = x2 * cr[half + i] + x1 * sr[half + i];
        }
      }
    }
  });
}

}  // namespace kvgen
