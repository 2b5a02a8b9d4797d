// Every decoder layer of a Llama-family or Gemma model in one op, over a static or a paged KV cache:
//   decoder_layers:       x [N = B T, C] rows; per layer l, weights[6 l ..] = (input_layernorm,
//                         qkv_proj, o_proj, post_attention_layernorm (Gemma: pre_feedforward_layernorm),
//                         gate_up_proj, down_proj), linears[8 l ..] = (weight_type, out_features) of the four
//                         projections, eps[3 l ..] = the eps of the two norms and of the q/k norms; extras: empty, or
//                         extras[8 l ..] = (qkv, o, gate_up, down biases, q_norm, k_norm weights, Gemma's
//                         post_attention_layernorm and post_feedforward_layernorm weights), each possibly None
//                         (Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head q/k RMSNorm before RoPE,
//                         rms_norm_heads_; Gemma's "sandwich" norms on the attention and MLP outputs before their
//                         residual adds, with the eps of the norm before them); layer_args: empty (every layer
//                         rotates by rope[0], rope[1] and sees every key) or 2 per layer: (r, window), r = 0 no
//                         RoPE (SmolLM3's NoPE layers), r > 0 the cos, sin pair rope[2 r - 2], rope[2 r - 1] [N, D]
//                         (Gemma 3: full and sliding layers have their own bases), window > 0 a sliding-window
//                         layer; activation 0 SwiGLU (silu_mul), 1 GeGLU (gelu_tanh_mul); softcap > 0: Gemma 2's
//                         capped scores; k_caches[l], v_caches[l] [B, Hkv, S_max, D] written at slots past_len ..
//                         (static_attention; int8 caches with their scales k_scales[l], v_scales[l], both lists
//                         empty for float16 and float32 caches). Returns x after the last layer.
//   paged_decoder_layers: the same over packed rows of several sequences, k_pools[l], v_pools[l]
//                         [num_blocks, Hkv, block_size, D] through block tables (paged_attention_qkv).
// Each layer runs the ops of LlamaDecoderLayer.forward_kernels (Gemma3DecoderLayer.forward_kernels) in the same
// order on the same operands (so the numbers are those ops' numbers), called here directly: one dispatch per forward
// instead of nine or more per layer, which at batch 1 is a sixth of a decode step.
#include "aten_lite.h"
#include "ops.h"
#include "team.h"

namespace kvgen {
namespace {

struct Layers {
  at::TensorList weights;
  at::IntArrayRef linears;
  at::ArrayRef<double> eps;
  const Extras& extras;
  at::IntArrayRef layer_args;
  at::TensorList rope;
  int64_t num_heads, num_kv_heads, activation;
};

// x + rms_norm(y, norm): Gemma's sandwich norm on an attention or MLP output before its residual add.
at::Tensor add_normed(const at::Tensor& x, at::Tensor y, const c10::optional<at::Tensor>& norm, double eps) {
  return rms_norm(y, *norm, eps).add_(x);
}

// The layer loop; attend(l, qkv [N, (H + 2 Hkv) D], window) stores layer l's k, v and returns [N, H D].
template <typename Attend>
at::Tensor run_layers(const at::Tensor& x_in, const Layers& p, size_t num_layers, Attend attend) {
  TORCH_CHECK(p.weights.size() == 6 * num_layers && p.linears.size() == 8 * num_layers && p.eps.size() == 3 * num_layers,
              "kvgen.decoder_layers: ", num_layers, " layers need 6 weights, 8 linear ints and 3 eps each");
  TORCH_CHECK(p.extras.empty() || p.extras.size() == 8 * num_layers, "kvgen.decoder_layers: extras must be empty or 8 "
              "per layer (4 biases, q_norm, k_norm, 2 post norms), got ", p.extras.size(), " for ", num_layers, " layers");
  TORCH_CHECK(p.layer_args.empty() || p.layer_args.size() == 2 * num_layers, "kvgen.decoder_layers: layer_args must be "
              "empty or 2 per layer (rope table, window), got ", p.layer_args.size(), " for ", num_layers, " layers");
  TORCH_CHECK(p.rope.size() % 2 == 0 && p.rope.size() >= 2, "kvgen.decoder_layers: rope holds (cos, sin) pairs");
  TORCH_CHECK(p.activation == 0 || p.activation == 1, "kvgen.decoder_layers: activation must be 0 (SwiGLU) or 1 (GeGLU)");
  for (size_t l = 0; l < p.layer_args.size() / 2; ++l)
    TORCH_CHECK(p.layer_args[2 * l] >= 0 && 2 * p.layer_args[2 * l] <= static_cast<int64_t>(p.rope.size()),
                "kvgen.decoder_layers: layer ", l, " names rope table ", p.layer_args[2 * l], " of ", p.rope.size() / 2);
  const auto extra = [&](size_t l, size_t i) -> c10::optional<at::Tensor> {
    if (p.extras.empty()) return c10::nullopt;
    return p.extras.get(8 * l + i);
  };
  at::Tensor x = x_in;
  for (size_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = p.weights.data() + 6 * l;
    const int64_t* lin = p.linears.data() + 8 * l;
    const int64_t table = p.layer_args.empty() ? 1 : p.layer_args[2 * l];
    const int64_t window = p.layer_args.empty() ? 0 : p.layer_args[2 * l + 1];
    at::Tensor h = rms_norm(x, w[0], p.eps[3 * l]);
    h = qgemm(h, w[1], lin[0], lin[1], extra(l, 0), c10::nullopt);  // [N, (H + 2 Hkv) D]
    const c10::optional<at::Tensor> q_norm = extra(l, 4), k_norm = extra(l, 5);
    if (q_norm.has_value() && k_norm.has_value())
      rms_norm_heads_(h, *q_norm, *k_norm, p.eps[3 * l + 2], p.num_heads, p.num_kv_heads);
    if (table > 0) rope_qkv_(h, p.rope[2 * table - 2], p.rope[2 * table - 1], p.num_heads, p.num_kv_heads);
    h = attend(l, h, window);  // [N, H D]
    const c10::optional<at::Tensor> post_attention = extra(l, 6), post_feedforward = extra(l, 7);
    x = post_attention.has_value()
            ? add_normed(x, qgemm(h, w[2], lin[2], lin[3], extra(l, 1), c10::nullopt), post_attention, p.eps[3 * l])
            : qgemm(h, w[2], lin[2], lin[3], extra(l, 1), x);  // x + o_proj(attn)
    h = rms_norm(x, w[3], p.eps[3 * l + 1]);
    h = qgemm(h, w[4], lin[4], lin[5], extra(l, 2), c10::nullopt);  // [N, 2 I]
    h = p.activation == 1 ? gelu_tanh_mul(h) : silu_mul(h);  // [N, I]
    x = post_feedforward.has_value()
            ? add_normed(x, qgemm(h, w[5], lin[6], lin[7], extra(l, 3), c10::nullopt), post_feedforward, p.eps[3 * l + 1])
            : qgemm(h, w[5], lin[6], lin[7], extra(l, 3), x);  // x + down_proj(act(gate) * up)
  }
  return x;
}

// Rows up to which a forward runs its layers in one thread team (team.h): a decode step's ~150 parallel ops a forward
// then cost no OpenMP fork each (batch-1 decode at 512 tokens of context: 263 -> 280 tok/s; engine steps of 4
// sequences -3 %, of 16 the same). A prefill's ops are long enough that the fork does not count, and its prompt ran
// 2-3 % slower in a team (512 tokens, 12 alternating pairs: 1,375 -> 1,346 tok/s), so it forks per op as before.
constexpr int64_t kTeamMaxRows = 16;

// f() -> Tensor, inside a thread team when the forward has at most kTeamMaxRows rows.
template <class F>
at::Tensor in_team(int64_t rows, const F& f) {
  if (rows > kTeamMaxRows) return f();
  at::Tensor out;
  Team::run([&] { out = f(); });
  return out;
}

// Both ops' loop: one v cache per k cache, the int8 caches' scales (one k and one v tensor per layer, or none for
// float16 and float32 caches), the layers in a team; attend(qkv, k, v, window, k_scale, v_scale) stores layer l's
// k, v in its caches and returns [N, H D].
template <typename Attend>
at::Tensor run_decoder(const at::Tensor& x, const Layers& p, at::TensorList k_caches, at::TensorList v_caches,
                       at::TensorList k_scales, at::TensorList v_scales, const char* op, Attend attend) {
  TORCH_CHECK(v_caches.size() == k_caches.size(), "kvgen.", op, ": one v cache per k cache");
  TORCH_CHECK(k_scales.size() == v_scales.size() && (k_scales.empty() || k_scales.size() == k_caches.size()), "kvgen.",
              op, ": k_scales and v_scales hold one tensor per layer (int8 caches) or none");
  const auto scale = [](at::TensorList scales, size_t l) {
    return scales.empty() ? c10::nullopt : c10::optional<at::Tensor>(scales[l]);
  };
  return in_team(x.size(0), [&] {
    return run_layers(x, p, k_caches.size(), [&](size_t l, const at::Tensor& qkv, int64_t window) {
      at::Tensor k = k_caches[l], v = v_caches[l];
      return attend(qkv, k, v, window, scale(k_scales, l), scale(v_scales, l));
    });
  });
}

}  // namespace

at::Tensor decoder_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef linears, at::ArrayRef<double> eps,
                          const Extras& extras, at::IntArrayRef layer_args, at::TensorList rope, at::TensorList k_caches,
                          at::TensorList v_caches, const c10::optional<at::Tensor>& key_mask, int64_t past_len,
                          int64_t num_heads, int64_t num_kv_heads, double scale, int64_t activation, double softcap,
                          at::TensorList k_scales, at::TensorList v_scales) {
  const Layers p{weights, linears, eps, extras, layer_args, rope, num_heads, num_kv_heads, activation};
  return run_decoder(x, p, k_caches, v_caches, k_scales, v_scales, "decoder_layers",
                     [&](const at::Tensor& qkv, at::Tensor& k, at::Tensor& v, int64_t window, const auto& ks,
                         const auto& vs) {
                       return static_attention(qkv, k, v, key_mask, past_len, num_heads, scale, window, softcap,
                                               c10::nullopt, ks, vs);
                     });
}

at::Tensor paged_decoder_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef linears,
                                at::ArrayRef<double> eps, const Extras& extras, at::IntArrayRef layer_args,
                                at::TensorList rope, at::TensorList k_pools, at::TensorList v_pools,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t num_heads,
                                int64_t num_kv_heads, double scale, int64_t activation, double softcap,
                                at::TensorList k_scales, at::TensorList v_scales) {
  const Layers p{weights, linears, eps, extras, layer_args, rope, num_heads, num_kv_heads, activation};
  return run_decoder(x, p, k_pools, v_pools, k_scales, v_scales, "paged_decoder_layers",
                     [&](const at::Tensor& qkv, at::Tensor& k, at::Tensor& v, int64_t window, const auto& ks,
                         const auto& vs) {
                       return paged_attention_qkv(qkv, k, v, slot_mapping, block_tables, query_start_loc, seq_lens,
                                                  num_heads, scale, window, softcap, c10::nullopt, ks, vs);
                     });
}

}  // namespace kvgen
