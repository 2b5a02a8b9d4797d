// The op entry points defined across the .cpp files, registered in ops.cpp (shapes and
// semantics: kvgen/kernels/__init__.py and each op's file header).
#pragma once

#include <vector>

#include "aten_lite.h"

namespace kvgen {

using Extras = c10::List<c10::optional<at::Tensor>>;  // Tensor?[]: per-layer optional operands

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& key_mask,
                     int64_t past_len, double scale, int64_t window, double softcap,
                     const c10::optional<at::Tensor>& sinks);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           double scale, int64_t window, double softcap, const c10::optional<at::Tensor>& sinks);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
void rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
                     int64_t num_heads, int64_t num_kv_heads);
void rope_qkv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
at::Tensor gpt_oss_glu(const at::Tensor& gate_up);
at::Tensor static_attention(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& key_mask, int64_t past_len, int64_t num_heads, double scale,
                            int64_t window, double softcap, const c10::optional<at::Tensor>& sinks,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);
at::Tensor paged_attention_qkv(const at::Tensor& qkv, at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slot_mapping,
                               const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                               const at::Tensor& seq_lens, int64_t num_heads, double scale, int64_t window,
                               double softcap, const c10::optional<at::Tensor>& sinks,
                               const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);
at::Tensor qgemm(const at::Tensor& x_in, const at::Tensor& weight, int64_t weight_type, int64_t out_features,
                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual);
at::Tensor decoder_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef linears, at::ArrayRef<double> eps,
                          const Extras& extras, at::IntArrayRef layer_args, at::TensorList rope, at::TensorList k_caches,
                          at::TensorList v_caches, const c10::optional<at::Tensor>& key_mask, int64_t past_len,
                          int64_t num_heads, int64_t num_kv_heads, double scale, int64_t activation, double softcap,
                          at::TensorList k_scales, at::TensorList v_scales);
at::Tensor paged_decoder_layers(const at::Tensor& x, at::TensorList weights, at::IntArrayRef linears,
                                at::ArrayRef<double> eps, const Extras& extras, at::IntArrayRef layer_args,
                                at::TensorList rope, at::TensorList k_pools, at::TensorList v_pools,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t num_heads,
                                int64_t num_kv_heads, double scale, int64_t activation, double softcap,
                                at::TensorList k_scales, at::TensorList v_scales);
at::Tensor repack_gguf(const std::vector<at::Tensor>& parts, int64_t gguf_type, const c10::optional<at::Tensor>& out);
at::Tensor recode_gguf(const at::Tensor& raw, int64_t ggml_type, const at::Tensor& grid);
at::Tensor linear_f64(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor argmax(const at::Tensor& x);
at::Tensor softmax_draw(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u);
at::Tensor filter_draw(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& min_p,
                       const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& u);
at::Tensor moe_experts_row(const at::Tensor& h, at::TensorList gate_up, at::IntArrayRef gate_up_linears,
                           at::TensorList down, at::IntArrayRef down_linears, at::ArrayRef<double> expert_weights,
                           const Extras& biases, int64_t activation);

}  // namespace kvgen
