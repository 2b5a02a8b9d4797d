// A mixture-of-experts layer's routed experts for one row (a decode step), in one op:
//   out = sum_j expert_weights[j] * down_j(act(gate_up_j(h))), j = 0 .. k-1 in the order given (the caller's:
//   ascending expert id), each term rounded (w * y) before it is added, as the torch loop it replaces
//   (kvgen.models.moe.experts_on_kernels: out.add_(qgemm(act(qgemm(h, gate_up)), down) * w)); act = silu_mul
//   (activation 0: Qwen-MoE, Mixtral) or gpt_oss_glu (1); biases: empty, or 2 per expert (gate_up's, down's; each
//   may be None), added by qgemm as it adds them.
// h [1, C] float32; gate_up[j] / down[j]: each expert's packed weights, gate_up_linears / down_linears the
// (weight_type, out_features) pairs of qgemm. The same qgemm and GLU ops run inside, so the bits are the loop's: a
// row's experts give what they give it among other rows (batch invariance). What it saves is the loop's ~6 op
// dispatches and Python steps per expert (~0.3 ms a layer at k = 8 of 128 experts, Qwen3-30B-A3B's shape).
#include <immintrin.h>

#include "aten_lite.h"

#include <cstring>

#include "ops.h"

namespace kvgen {

at::Tensor moe_experts_row(const at::Tensor& h, at::TensorList gate_up, at::IntArrayRef gate_up_linears,
                           at::TensorList down, at::IntArrayRef down_linears, at::ArrayRef<double> expert_weights,
                           const Extras& biases, int64_t activation) {
  const int64_t k = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(h.dtype() == at::kFloat && h.dim() == 2 && h.size(0) == 1, "kvgen.moe_experts_row: h must be float32 [1, C]");
  TORCH_CHECK(k >= 1 && static_cast<int64_t>(down.size()) == k && static_cast<int64_t>(expert_weights.size()) == k &&
                  static_cast<int64_t>(gate_up_linears.size()) == 2 * k && static_cast<int64_t>(down_linears.size()) == 2 * k,
              "kvgen.moe_experts_row: k >= 1 experts, each with gate_up, down, (type, out_features) of both and a weight");
  TORCH_CHECK(biases.size() == 0 || static_cast<int64_t>(biases.size()) == 2 * k,
              "kvgen.moe_experts_row: biases must be empty or 2 per expert, got ", biases.size());
  TORCH_CHECK(activation == 0 || activation == 1, "kvgen.moe_experts_row: activation must be 0 (SiLU) or 1 (gpt-oss), got ",
              activation);
  const int64_t C = h.size(1);
  at::Tensor out = at::empty({1, C}, h.options());
  float* op = out.data_ptr<float>();
  std::memset(op, 0, C * sizeof(float));
  for (int64_t j = 0; j < k; ++j) {
    const c10::optional<at::Tensor> gb = biases.size() ? biases.get(2 * j) : c10::nullopt;
    const c10::optional<at::Tensor> db = biases.size() ? biases.get(2 * j + 1) : c10::nullopt;
    const at::Tensor g = qgemm(h, gate_up[j], gate_up_linears[2 * j], gate_up_linears[2 * j + 1], gb, c10::nullopt);
    const at::Tensor a = activation == 0 ? silu_mul(g) : gpt_oss_glu(g);
    const at::Tensor y = qgemm(a, down[j], down_linears[2 * j], down_linears[2 * j + 1], db, c10::nullopt);
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
