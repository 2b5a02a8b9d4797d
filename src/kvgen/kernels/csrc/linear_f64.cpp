// linear_f64: out [N, E] float32 = x [N, C] float32 @ weight [E, C] float32 ^T (+ bias [E] float32), every product
// and sum in float64 and each output rounded once to float32: what F.linear(x.double(), weight.double(),
// bias.double()).float() computes (its twin), reading the weights as float32 (half the bytes of a float64 copy).
// Each output is one dot product in a fixed order (four 4-lane float64 accumulators over 16-column steps, added
// (0 + 1) + (2 + 3), the lanes 0 .. 3 in order, then the tail columns, then the bias), so a row's values do not
// depend on the other rows or the threads: mixture-of-experts routers use it, whose near-tied choices a float32
// GEMM would move between a row alone (decode) and the same row in a batch (prefill, the engine).
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "aten_lite.h"

namespace kvgen {
namespace {

// sum_c x[c] w[c] in float64, x already float64.
inline double dot_f64(const double* x, const float* w, int64_t C) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t c = 0;
  for (; c + 16 <= C; c += 16)
    for (int i = 0; i < 4; ++i)
      acc[i] = _mm256_fmadd_pd(_mm256_loadu_pd(x + c + 4 * i), _mm256_cvtps_pd(_mm_loadu_ps(w + c + 4 * i)), acc[i]);
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
  double s = ((lanes[0] + lanes[1]) + lanes[2]) + lanes[3];
  for (; c < C; ++c) s += x[c] * static_cast<double>(w[c]);
  return s;
}

}  // namespace

at::Tensor linear_f64(const at::Tensor& x_in, const at::Tensor& weight_in, const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dtype() == at::kFloat && x_in.dim() == 2, "kvgen.linear_f64: x must be float32 [N, C]");
  TORCH_CHECK(weight_in.dtype() == at::kFloat && weight_in.dim() == 2 && weight_in.size(1) == x_in.size(1),
              "kvgen.linear_f64: weight must be float32 [E, C] with x's C");
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  TORCH_CHECK(!has_bias || (bias_in->dtype() == at::kFloat && bias_in->numel() == weight_in.size(0)),
              "kvgen.linear_f64: bias must be float32 [E]");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor bias = has_bias ? bias_in->contiguous() : at::Tensor();
  const int64_t N = x.size(0), C = x.size(1), E = weight.size(0);
  at::Tensor out = at::empty({N, E}, x.options());
  std::vector<double> x64(N * C);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < N * C; ++i) x64[i] = static_cast<double>(xp[i]);
  const float* wp = weight.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // (row, expert) pairs over threads, a few thousand columns' work at least (one router row at decode is E of them)
  at::parallel_for(0, N * E, std::max<int64_t>(1, (1 << 13) / std::max<int64_t>(C, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / E, e = i % E;
      double s = dot_f64(x64.data() + n * C, wp + e * C, C);
      if (bp) s += static_cast<double>(bp[e]);
      op[i] = static_cast<float>(s);
    }
  });
  return out;
}

}  // namespace kvgen
