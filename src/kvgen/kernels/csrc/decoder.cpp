// Every decoder layer of a Llama-family model in one op, for a static KV cache:
//   decoder_layers: x [N = B T, C] rows; per layer l, weights[6 l ..] = (input_layernorm, qkv_proj,
//                   o_proj, post_attention_layernorm, gate_up_proj, down_proj), linears[8 l ..] =
//                   (weight_type, out_features) of the four projections, eps[2 l ..] = the two
//                   norms' eps; k_caches[l], v_caches[l] [B, Hkv, S_max, D] written at slots
//                   past_len ... Returns x after the last layer [N, C].
// Each layer runs the nine ops of LlamaDecoderLayer.forward_kernels in the same order on the same
// operands (so the numbers are those ops' numbers), called here directly: one dispatch per forward
// instead of nine per layer, which at batch 1 is a tenth of a decode step.
#include "aten_lite.h"
#include "ops.h"

namespace kvgen {

at::Tensor decoder_layers(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef linears, at::ArrayRef<double> eps,
                          const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                          const c10::optional<at::Tensor>& key_mask, int64_t past_len, int64_t num_heads,
                          int64_t num_kv_heads, double scale) {
  const size_t L = k_caches.size();
  TORCH_CHECK(v_caches.size() == L && weights.size() == 6 * L && linears.size() == 8 * L && eps.size() == 2 * L,
              "kvgen.decoder_layers: ", L, " layers need 6 weights, 8 linear ints and 2 eps each, and as many v caches");
  at::Tensor x = x_in;
  for (size_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + 6 * l;
    const int64_t* lin = linears.data() + 8 * l;
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    at::Tensor h = rms_norm(x, w[0], eps[2 * l]);
    h = qgemm(h, w[1], lin[0], lin[1], c10::nullopt, c10::nullopt);  // [N, (H + 2 Hkv) D]
    rope_qkv_(h, cos, sin, num_heads, num_kv_heads);
    h = static_attention(h, k_cache, v_cache, key_mask, past_len, num_heads, scale);  // [N, H D]
    x = qgemm(h, w[2], lin[2], lin[3], c10::nullopt, x);  // x + o_proj(attn)
    h = rms_norm(x, w[3], eps[2 * l + 1]);
    h = qgemm(h, w[4], lin[4], lin[5], c10::nullopt, c10::nullopt);  // [N, 2 I]
    x = qgemm(silu_mul(h), w[5], lin[6], lin[7], c10::nullopt, x);  // x + down_proj(silu(gate) * up)
  }
  return x;
}

}  // namespace kvgen
