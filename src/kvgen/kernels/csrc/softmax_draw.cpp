// One id per row drawn from softmax(logits / temperature) by inversion, without materializing the
// distribution: softmax_draw(logits [B, V] f32, temperature [B] f64, u [B] f64) -> [B] i64.
// Row b: weights w_i = exp((x_i - max x) / t_b) (8 lanes, vec_math's exp256; -inf gives 0), summed
// in float64 per block of kDrawBlock ids; the target u_b * total falls in the first block whose
// cumulative sum exceeds it (else, rounding, the last block with weight), and inside that block in
// the first id whose cumulative weight exceeds the remainder (else the block's last id with weight):
// the two-level search of kvgen.sampling.ops.sample_inverse_cdf, its torch twin. The block's weights
// are recomputed by the same instructions, so both levels see the same numbers. A zero-weight id is
// never drawn; rows run in parallel, each alone, so a row's id does not depend on the batch.
// Source: inverse transform sampling (Devroye 1986, II.2); the engine's draw (vLLM v1 samples from
// probs by exponential race; one uniform per row here).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "aten_lite.h"
#include "vec_math.h"

namespace kvgen {
namespace {

constexpr int64_t kDrawBlock = 256;  // ids per first-level block (ops._CDF_BLOCK)

// w[0 .. n) = exp((x[i] - m) * inv_t) for one block (n <= kDrawBlock); the tail lanes of the last vector are 0.
inline void block_weights(const float* x, int64_t n, float m, float inv_t, float* w) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(w + i, exp256(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), vt)));
  if (i < n) {
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = i + j < n ? x[i + j] : -std::numeric_limits<float>::infinity();
    _mm256_storeu_ps(w + i, exp256(_mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(tail), vm), vt)));
  }
}

// sum of w[0 .. n) in float64 (4 lanes; n <= kDrawBlock, w padded with zeros to a multiple of 8)
inline double block_sum(const float* w, int64_t n) {
  __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();
  for (int64_t i = 0; i < n; i += 8) {
    a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm_loadu_ps(w + i)));
    b = _mm256_add_pd(b, _mm256_cvtps_pd(_mm_loadu_ps(w + i + 4)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a, b));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

int64_t draw_row(const float* x, int64_t V, float inv_t, double u, double* block_sums) {
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());  // max is exact in any order
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float m = *std::max_element(lanes, lanes + 8);
  for (; i < V; ++i) m = std::max(m, x[i]);
  TORCH_CHECK(m > -std::numeric_limits<float>::infinity(), "kvgen.softmax_draw: a row has no finite logit");
  const int64_t nb = (V + kDrawBlock - 1) / kDrawBlock;
  alignas(32) float w[kDrawBlock + 8];
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t n = std::min(kDrawBlock, V - b * kDrawBlock);
    block_weights(x + b * kDrawBlock, n, m, inv_t, w);
    block_sums[b] = block_sum(w, n);
    total += block_sums[b];
  }
  const double target = u * total;
  double before = 0.0;
  int64_t block = -1, last = -1;
  for (int64_t b = 0; b < nb; ++b) {
    if (block_sums[b] > 0.0) last = b;
    if (before + block_sums[b] > target) {
      block = b;
      break;
    }
    before += block_sums[b];
  }
  if (block < 0) {  // rounding: u * total reached the sum of every block
    block = last;
    before = 0.0;
    for (int64_t b = 0; b < last; ++b) before += block_sums[b];
  }
  const int64_t n = std::min(kDrawBlock, V - block * kDrawBlock);
  block_weights(x + block * kDrawBlock, n, m, inv_t, w);
  const double rest = target - before;
  double cum = 0.0;
  int64_t id = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] > 0.0f) {
      id = i;
      cum += w[i];
      if (cum > rest) break;
    }
  }
  return block * kDrawBlock + id;
}

}  // namespace

at::Tensor softmax_draw(const at::Tensor& logits_in, const at::Tensor& temperature_in, const at::Tensor& u_in) {
  TORCH_CHECK(logits_in.dtype() == at::kFloat && logits_in.dim() == 2 && logits_in.size(1) > 0,
              "kvgen.softmax_draw: logits must be float32 [B, V]");
  const int64_t B = logits_in.size(0), V = logits_in.size(1);
  TORCH_CHECK(temperature_in.numel() == B && u_in.numel() == B, "kvgen.softmax_draw: temperature and u must be [B=", B,
              "], got ", temperature_in.sizes(), " and ", u_in.sizes());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor temperature = temperature_in.to(at::kDouble).contiguous(), u = u_in.to(at::kDouble).contiguous();
  const double* tp = temperature.data_ptr<double>();
  const double* up = u.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(tp[b] > 0.0 && std::isfinite(tp[b]) && up[b] >= 0.0 && up[b] < 1.0, "kvgen.softmax_draw: row ", b,
                " needs temperature > 0 and u in [0, 1), got ", tp[b], " and ", up[b]);
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> block_sums((V + kDrawBlock - 1) / kDrawBlock);
    for (int64_t b = begin; b < end; ++b)
      op[b] = draw_row(xp + b * V, V, static_cast<float>(1.0 / tp[b]), up[b], block_sums.data());
  });
  return out;
}

}  // namespace kvgen
