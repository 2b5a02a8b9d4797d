// Cache write + paged attention in one op, from the stacked qkv rows of a layer (the engine
// step's hot path; the static cache's twin, static_attention, is in attention.cpp).
//   paged_attention_qkv: qkv [N, (H + 2 Hkv) D]; pools [num_blocks, block_size, Hkv, D]
//                        written at slot_mapping [N], then `paged_attention`. Returns [N, H*D].
// The numbers are those of `attention` / `paged_attention` on the same inputs.
#include <ATen/ops/index_copy.h>

#include "aten_lite.h"
#include "ops.h"

namespace kvgen {

at::Tensor paged_attention_qkv(const at::Tensor& qkv, at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slot_mapping,
                               const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                               const at::Tensor& seq_lens, int64_t num_heads, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "kvgen.paged_attention_qkv: qkv [N, W], contiguous pools [num_blocks, block_size, Hkv, D]");
  const int64_t Hkv = k_pool.size(2), D = k_pool.size(3), N = qkv.size(0), H = num_heads;
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D && slot_mapping.numel() == N, "kvgen.paged_attention_qkv: qkv ",
              qkv.sizes(), " / slot_mapping do not fit the pools");
  const at::Tensor k = qkv.narrow(1, H * D, Hkv * D).reshape({N, Hkv, D}).to(k_pool.scalar_type());
  const at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).reshape({N, Hkv, D}).to(v_pool.scalar_type());
  k_pool.view({-1, Hkv, D}).index_copy_(0, slot_mapping, k);
  v_pool.view({-1, Hkv, D}).index_copy_(0, slot_mapping, v);
  const at::Tensor q = qkv.narrow(1, 0, H * D).view({N, H, D});
  return paged_attention(q, k_pool, v_pool, block_tables, query_start_loc, seq_lens, scale).view({N, H * D});
}

}  // namespace kvgen
