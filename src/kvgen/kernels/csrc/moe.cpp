// A mixture-of-experts layer's routed experts for one row (a decode step), in one op:
//   out = sum_j expert_weights[j] * down_j(silu_mul(gate_up_j(h))), j = 0 .. k-1 in the order given (the caller's:
//   ascending expert id), each term rounded (w * y) before it is added, as the torch loop it replaces
//   (kvgen.models.moe.experts_on_kernels: out.add_(qgemm(silu_mul(qgemm(h, gate_up)), down) * w)).
// h [1, C] float32; gate_up[j] / down[j]: each expert's packed weights, gate_up_linears / down_linears the
// (weight_type, out_features) pairs of qgemm. The same qgemm and silu_mul run inside, so the bits are the loop's: a
// row's experts give what they give it among other rows (batch invariance). What it saves is the loop's ~6 op
// dispatches and Python steps per expert (~0.4 ms a layer at k = 8).
#include "aten_lite.h"

#include <cstring>

#include "ops.h"

namespace kvgen {

at::Tensor moe_experts_row(const at::Tensor& h, at::TensorList gate_up, at::IntArrayRef gate_up_linears,
                           at::TensorList down, at::IntArrayRef down_linears, at::ArrayRef<double> expert_weights) {
  const int64_t k = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(h.dtype() == at::kFloat && h.dim() == 2 && h.size(0) == 1, "kvgen.moe_experts_row: h must be float32 [1, C]");
  TORCH_CHECK(k >= 1 && static_cast<int64_t>(down.size()) == k && static_cast<int64_t>(expert_weights.size()) == k &&
                  static_cast<int64_t>(gate_up_linears.size()) == 2 * k && static_cast<int64_t>(down_linears.size()) == 2 * k,
              "kvgen.moe_experts_row: k >= 1 experts, each with gate_up, down, (type, out_features) of both and a weight");
  const int64_t C = h.size(1);
  at::Tensor out = at::empty({1, C}, h.options());
  float* op = out.data_ptr<float>();
  std::memset(op, 0, C * sizeof(float));
  for (int64_t j = 0; j < k; ++j) {
    const at::Tensor g = qgemm(h, gate_up[j], gate_up_linears[2 * j], gate_up_linears[2 * j + 1], c10::nullopt, c10::nullopt);
    const at::Tensor y = qgemm(silu_mul(g), down[j], down_linears[2 * j], down_linears[2 * j + 1], c10::nullopt, c10::nullopt);
    TORCH_CHECK(y.size(1) == C, "kvgen.moe_experts_row: expert ", j, "'s down projection gives ", y.size(1),
                " columns, h has ", C);
    const float* yp = y.data_ptr<float>();
    const float w = static_cast<float>(expert_weights[j]);
    int64_t c = 0;
    const __m256 wv = _mm256_set1_ps(w);
    for (; c + 8 <= C; c += 8) {
      __m256 p = _mm256_mul_ps(_mm256_loadu_ps(yp + c), wv);
      asm volatile("" : "+x"(p));  // rounded product, then the add: never one fused multiply-add
      _mm256_storeu_ps(op + c, _mm256_add_ps(_mm256_loadu_ps(op + c), p));
    }
    for (; c < C; ++c) {
      float p = yp[c] * w;
      asm volatile("" : "+x"(p));
      op[c] += p;
    }
  }
  return out;
}

}  // namespace kvgen
