// Every decoder layer of a Llama-family model in one op, over a static or a paged KV cache:
//   decoder_layers:       x [N = B T, C] rows; per layer l, weights[6 l ..] = (input_layernorm,
//                         qkv_proj, o_proj, post_attention_layernorm, gate_up_proj, down_proj),
//                         linears[8 l ..] = (weight_type, out_features) of the four projections,
//                         eps[3 l ..] = the eps of the two norms and of the q/k norms; extras: empty, or
//                         extras[6 l ..] = (qkv, o, gate_up, down biases, q_norm, k_norm weights), each
//                         possibly None (Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm before RoPE,
//                         rms_norm_heads_); use_rope: empty (every layer) or a 0/1 per layer (0: the layer
//                         skips RoPE, SmolLM3's NoPE layers); k_caches[l], v_caches[l] [B, Hkv, S_max, D]
//                         written at slots past_len .. (static_attention). Returns x after the last layer.
//   paged_decoder_layers: the same over packed rows of several sequences, k_pools[l], v_pools[l]
//                         [num_blocks, block_size, Hkv, D] through block tables (paged_attention_qkv).
// Each layer runs the nine ops of LlamaDecoderLayer.forward_kernels in the same order on the same
// operands (so the numbers are those ops' numbers), called here directly: one dispatch per forward
// instead of nine per layer, which at batch 1 is a sixth of a decode step.
#include "aten_lite.h"
#include "ops.h"

namespace kvgen {
namespace {

// The layer loop; attend(l, qkv [N, (H + 2 Hkv) D]) stores layer l's k, v and returns [N, H D].
template <typename Attend>
at::Tensor run_layers(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef linears, at::ArrayRef<double> eps,
                      const Extras& extras, at::IntArrayRef use_rope, const at::Tensor& cos, const at::Tensor& sin,
                      size_t num_layers, int64_t num_heads, int64_t num_kv_heads, Attend attend) {
  TORCH_CHECK(weights.size() == 6 * num_layers && linears.size() == 8 * num_layers && eps.size() == 3 * num_layers,
              "kvgen.decoder_layers: ", num_layers, " layers need 6 weights, 8 linear ints and 3 eps each");
  TORCH_CHECK(extras.empty() || extras.size() == 6 * num_layers, "kvgen.decoder_layers: extras must be empty or 6 per "
              "layer (4 biases, q_norm, k_norm), got ", extras.size(), " for ", num_layers, " layers");
  TORCH_CHECK(use_rope.empty() || use_rope.size() == num_layers, "kvgen.decoder_layers: use_rope must be empty or one "
              "flag per layer, got ", use_rope.size(), " for ", num_layers, " layers");
  const auto extra = [&](size_t l, size_t i) -> c10::optional<at::Tensor> {
    if (extras.empty()) return c10::nullopt;
    return extras.get(6 * l + i);
  };
  at::Tensor x = x_in;
  for (size_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + 6 * l;
    const int64_t* lin = linears.data() + 8 * l;
    at::Tensor h = rms_norm(x, w[0], eps[3 * l]);
    h = qgemm(h, w[1], lin[0], lin[1], extra(l, 0), c10::nullopt);  // [N, (H + 2 Hkv) D]
    const c10::optional<at::Tensor> q_norm = extra(l, 4), k_norm = extra(l, 5);
    if (q_norm.has_value() && k_norm.has_value()) rms_norm_heads_(h, *q_norm, *k_norm, eps[3 * l + 2], num_heads, num_kv_heads);
    if (use_rope.empty() || use_rope[l] != 0) rope_qkv_(h, cos, sin, num_heads, num_kv_heads);
    h = attend(l, h);  // [N, H D]
    x = qgemm(h, w[2], lin[2], lin[3], extra(l, 1), x);  // x + o_proj(attn)
    h = rms_norm(x, w[3], eps[3 * l + 1]);
    h = qgemm(h, w[4], lin[4], lin[5], extra(l, 2), c10::nullopt);  // [N, 2 I]
    x = qgemm(silu_mul(h), w[5], lin[6], lin[7], extra(l, 3), x);  // x + down_proj(silu(gate) * up)
  }
  return x;
}

}  // namespace

at::Tensor decoder_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef linears, at::ArrayRef<double> eps,
                          const Extras& extras, at::IntArrayRef use_rope, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                          const c10::optional<at::Tensor>& key_mask, int64_t past_len, int64_t num_heads,
                          int64_t num_kv_heads, double scale) {
  TORCH_CHECK(v_caches.size() == k_caches.size(), "kvgen.decoder_layers: one v cache per k cache");
  return run_layers(x, weights, linears, eps, extras, use_rope, cos, sin, k_caches.size(), num_heads, num_kv_heads,
                    [&](size_t l, const at::Tensor& qkv) {
                      at::Tensor k = k_caches[l], v = v_caches[l];
                      return static_attention(qkv, k, v, key_mask, past_len, num_heads, scale, 0, 0.0);  // no window, no softcap
                    });
}

at::Tensor paged_decoder_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef linears,
                                at::ArrayRef<double> eps, const Extras& extras, at::IntArrayRef use_rope, const at::Tensor& cos, const at::Tensor& sin,
                                at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& slot_mapping,
                                const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, double scale) {
  TORCH_CHECK(v_pools.size() == k_pools.size(), "kvgen.paged_decoder_layers: one v pool per k pool");
  return run_layers(x, weights, linears, eps, extras, use_rope, cos, sin, k_pools.size(), num_heads, num_kv_heads,
                    [&](size_t l, const at::Tensor& qkv) {
                      at::Tensor k = k_pools[l], v = v_pools[l];
                      return paged_attention_qkv(qkv, k, v, slot_mapping, block_tables, query_start_loc, seq_lens,
                                                 num_heads, scale, 0, 0.0);  // no window or softcap: Llama-family layers
                    });
}

}  // namespace kvgen
