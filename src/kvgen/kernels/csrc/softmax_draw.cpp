// The engine's token choice. filter_draw (below) adds the sampling filters before the same draw; argmax (at the
// end) is the greedy choice.
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

// max of x[0 .. V) (exact in any order)
inline float row_max(const float* x, int64_t V) {
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float m = *std::max_element(lanes, lanes + 8);
  for (; i < V; ++i) m = std::max(m, x[i]);
  return m;
}

int64_t draw_row(const float* x, int64_t V, float inv_t, double u, double* block_sums) {
  const float m = row_max(x, V);
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

// ---- filter_draw: the engine's sampling stages (temperature -> min_p -> top_k -> top_p, vLLM v1's order) and
// the draw, per row. Each filter decides from float64 math on the float32 row; where float32 rounding in the torch
// ops could decide otherwise (within kMargin of a threshold, tied logits at the top-p cut, a cut beyond the
// candidates) the row returns -1 and the caller runs the torch ops for it, so every id equals the twin's
// (reference.filter_draw). Once top_k or top_p has cut the row to a few entries, they are kept as a list and
// drawn from it (sparse_draw: draw_row's sums over only the nonzero weights, in the same order, so the same id).

constexpr double kMargin = 1e-4;  // min_p: in log-probability; top_p: in cumulative probability (ops._TOP_P_MARGIN)
constexpr int64_t kTopPCandidates[] = {64, 1024};  // largest logits top-p decides from (ops._TOP_P_CANDIDATES)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLowest = std::numeric_limits<float>::lowest();

struct Candidate {
  float value;
  int64_t id;
};

struct RowScratch {
  std::vector<float> z;  // the row while it is dense
  std::vector<double> block_sums;
  std::vector<float> block_max;
  std::vector<Candidate> candidates;  // collected entries; the kept ones once the row is sparse
  std::vector<double> cumulative;
};

inline bool by_value(const Candidate& a, const Candidate& b) { return a.value > b.value || (a.value == b.value && a.id < b.id); }

// Every finite entry of z [V] at least the n-th largest finite one into s.candidates, the first min(n, count) sorted
// by value descending (ties by id), the rest after them unsorted. The n-th largest is at least the n-th largest of
// >= 2n block maxima, so only entries at least that are collected.
void collect_largest(const float* z, int64_t V, int64_t n, RowScratch& s) {
  float tau = kLowest;  // finite entries only
  const int64_t block = (V / (2 * n)) & ~int64_t{7};
  if (block >= 8) {
    const int64_t nb = V / block;  // whole blocks (>= 2n); the tail is collected below like the rest
    s.block_max.resize(nb);
    for (int64_t b = 0; b < nb; ++b) s.block_max[b] = row_max(z + b * block, block);
    std::nth_element(s.block_max.begin(), s.block_max.begin() + (n - 1), s.block_max.end(), std::greater<float>());
    tau = std::max(tau, s.block_max[n - 1]);
  }
  s.candidates.clear();
  const __m256 vt = _mm256_set1_ps(tau);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8)
    for (int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + i), vt, _CMP_GE_OQ)); mask; mask &= mask - 1)
      s.candidates.push_back({z[i + __builtin_ctz(mask)], i + __builtin_ctz(mask)});
  for (; i < V; ++i)
    if (z[i] >= tau) s.candidates.push_back({z[i], i});
  const int64_t sorted = std::min<int64_t>(n, static_cast<int64_t>(s.candidates.size()));
  std::partial_sort(s.candidates.begin(), s.candidates.begin() + sorted, s.candidates.end(), by_value);
}

// min_p: torch removes softmax(z)_i < min_p * max softmax(z), i.e. z_i < m + log(min_p) up to float32 rounding
// (~1e-6 here); entries removed become -inf and leave num_finite, and when at most kSparse stay they are listed in
// s.candidates (sparse). Returns 0 (undecided: an entry other than the max within kMargin of that line), 1 (dense)
// or 2 (sparse).
constexpr int64_t kSparse = 4096;  // most entries min_p may keep for the row to be drawn from a list

int apply_min_p(float* z, int64_t V, float m, double min_p, int64_t& num_finite, RowScratch& s) {
  const float scale = static_cast<float>(min_p);  // ops.apply_min_p's float32 column
  if (!(scale > 0.0f)) return 1;  // rounds to 0: nothing is below 0
  const double log_scale = std::log(static_cast<double>(scale));
  if (log_scale < -60.0) return 0;  // the torch op's probabilities would be denormal there
  const double line = static_cast<double>(m) + log_scale;
  const float lo = std::nextafter(static_cast<float>(line - kMargin), kNegInf);
  const float hi = std::nextafter(static_cast<float>(line + kMargin), std::numeric_limits<float>::infinity());
  const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(kNegInf);
  s.candidates.clear();
  int64_t kept = 0, i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 x = _mm256_loadu_ps(z + i);
    const __m256 below = _mm256_cmp_ps(x, vlo, _CMP_LT_OQ);  // -inf included
    const __m256 near = _mm256_andnot_ps(below, _mm256_and_ps(_mm256_cmp_ps(x, vhi, _CMP_LE_OQ), _mm256_cmp_ps(x, vm, _CMP_NEQ_OQ)));
    if (_mm256_movemask_ps(near)) return 0;
    int stay = ~_mm256_movemask_ps(below) & 0xff;
    if (stay) {
      _mm256_storeu_ps(z + i, _mm256_blendv_ps(x, ninf, below));
      for (kept += __builtin_popcount(stay); stay && kept <= kSparse; stay &= stay - 1)
        s.candidates.push_back({z[i + __builtin_ctz(stay)], i + __builtin_ctz(stay)});
    } else {
      _mm256_storeu_ps(z + i, ninf);
    }
  }
  for (; i < V; ++i) {
    if (z[i] < lo) {
      z[i] = kNegInf;
    } else if (z[i] <= hi && z[i] != m) {
      return 0;
    } else if (++kept <= kSparse) {
      s.candidates.push_back({z[i], i});
    }
  }
  num_finite = kept;
  return kept <= kSparse ? 2 : 1;
}

// top_k: keep entries >= the k-th largest (ties at it stay; -inf entries count, as in torch.topk), from the row
// or (sparse) from s.candidates. Returns whether the kept entries are listed in s.candidates.
bool apply_top_k(const float* z, int64_t V, int64_t top_k, int64_t num_finite, bool sparse, RowScratch& s) {
  const int64_t k = std::min(std::max<int64_t>(top_k, 1), V);
  if (num_finite <= k) return sparse;  // the k-th is -inf: nothing is below it
  if (sparse) std::nth_element(s.candidates.begin(), s.candidates.begin() + (k - 1), s.candidates.end(), by_value);
  else collect_largest(z, V, k, s);
  const float kth = s.candidates[k - 1].value;
  s.candidates.erase(std::remove_if(s.candidates.begin() + k, s.candidates.end(),
                                    [kth](const Candidate& c) { return c.value < kth; }), s.candidates.end());
  return true;
}

// top_p's decision from candidates, the largest entries of the row sorted by value descending (all of its finite
// entries when `covers`; otherwise its whole top `sum` being the row's sum of exp(z - m)): 1 with the kept ones left
// in s.candidates, 0 when the cut may lie beyond them, -1 when float32 rounding in the torch op could cut elsewhere
// (within kMargin of the threshold, or tied logits at the cut; as ops._top_p_from_candidates).
int top_p_cut(float m, double threshold, bool covers, double sum, RowScratch& s) {
  const int64_t nc = static_cast<int64_t>(s.candidates.size());
  s.cumulative.resize(nc);  // first the weights exp(z - m), then the ascending cumulative probabilities
  double covered = 0.0;
  for (int64_t r = 0; r < nc; ++r) covered += s.cumulative[r] = std::exp(static_cast<double>(s.candidates[r].value) - m);
  if (covers) sum = covered;
  double above = 0.0;
  for (int64_t r = 0; r < nc; ++r) {
    const double weight = s.cumulative[r];
    s.cumulative[r] = 1.0 - above / sum;  // 1 - the mass ranked above candidate r
    above += weight;
  }
  int64_t cut = 0;
  while (cut < nc && s.cumulative[cut] > threshold) ++cut;
  cut = std::max<int64_t>(cut, 1);
  const bool last_in_certain = cut == 1 || s.cumulative[cut - 1] > threshold + kMargin;
  if (cut >= nc) {
    if (!covers) return 0;
    return last_in_certain ? 1 : -1;  // every finite entry stays
  }
  if (!(s.cumulative[cut] <= threshold - kMargin && last_in_certain && s.candidates[cut].value != s.candidates[cut - 1].value))
    return -1;
  s.candidates.resize(cut);
  return 1;
}

// top_p (HF's rule: sorted ascending, remove cumulative <= 1 - p, keep the top one) on the row (sparse: its finite
// entries listed in s.candidates), decided from its largest 64, then 1,024 entries. Returns whether it decided,
// the kept entries then listed in s.candidates.
bool apply_top_p(const float* z, int64_t V, float m, double top_p, bool sparse, int64_t num_finite, RowScratch& s) {
  const double threshold = static_cast<double>(static_cast<float>(1.0 - top_p));  // rounded as ops.apply_top_p
  if (sparse) {
    std::sort(s.candidates.begin(), s.candidates.end(), by_value);
    return top_p_cut(m, threshold, true, 0.0, s) == 1;
  }
  double total = -1.0;  // sum of exp(z_i - m) over the row, once needed
  for (const int64_t n : kTopPCandidates) {
    const bool covers = num_finite <= n;
    collect_largest(z, V, covers ? num_finite : n, s);
    s.candidates.resize(std::min<int64_t>(n, static_cast<int64_t>(s.candidates.size())));
    if (!covers && total < 0.0) {
      total = 0.0;
      alignas(32) float w[kDrawBlock + 8];
      for (int64_t b = 0; b * kDrawBlock < V; ++b) {
        const int64_t len = std::min(kDrawBlock, V - b * kDrawBlock);
        block_weights(z + b * kDrawBlock, len, m, 1.0f, w);
        total += block_sum(w, len);
      }
    }
    const int how = top_p_cut(m, threshold, covers, total, s);
    if (how != 0) return how == 1;
  }
  return false;  // a flat row's cut lies further down (the torch op sorts the whole row)
}

// draw_row(z, V, 1, u) for a row whose finite entries are `kept` (any order; sorted here by id): the same weights
// (exp256 lane by lane), the same float64 sums in the same order with the zero terms left out, the same search.
int64_t sparse_draw(std::vector<Candidate>& kept, float m, double u) {
  std::sort(kept.begin(), kept.end(), [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
  const int64_t n = static_cast<int64_t>(kept.size());
  std::vector<float> w(n + 8);
  const __m256 vm = _mm256_set1_ps(m), one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    alignas(32) float x[8];
    for (int j = 0; j < 8; ++j) x[j] = i + j < n ? kept[i + j].value : kNegInf;
    _mm256_storeu_ps(w.data() + i, exp256(_mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(x), vm), one)));
  }
  // block sums: lane L of a block accumulates the weights of ids = L (mod 8) in id order (block_sum's a and b)
  std::vector<std::pair<int64_t, double>> blocks;  // (block, sum), blocks with a kept entry, in order
  std::vector<int64_t> starts;  // index in kept of each listed block's first entry
  for (int64_t i = 0; i < n;) {
    const int64_t block = kept[i].id / kDrawBlock;
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    starts.push_back(i);
    for (; i < n && kept[i].id / kDrawBlock == block; ++i) lanes[kept[i].id % 8] += w[i];
    blocks.push_back({block, ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))});
  }
  double total = 0.0;
  for (const auto& b : blocks) total += b.second;
  const double target = u * total;
  double before = 0.0;
  int64_t chosen = -1, last = -1;
  for (int64_t j = 0; j < static_cast<int64_t>(blocks.size()); ++j) {
    if (blocks[j].second > 0.0) last = j;
    if (before + blocks[j].second > target) {
      chosen = j;
      break;
    }
    before += blocks[j].second;
  }
  if (chosen < 0) {  // rounding: u * total reached the sum of every block
    chosen = last;
    before = 0.0;
    for (int64_t j = 0; j < last; ++j) before += blocks[j].second;
  }
  const double rest = target - before;
  const int64_t end = chosen + 1 < static_cast<int64_t>(starts.size()) ? starts[chosen + 1] : n;
  double cum = 0.0;
  int64_t id = -1;
  for (int64_t i = starts[chosen]; i < end; ++i) {
    if (w[i] > 0.0f) {
      id = kept[i].id;
      cum += w[i];
      if (cum > rest) break;
    }
  }
  return id;
}

// One row: the id drawn, or -1 where a filter is undecided.
int64_t filter_draw_row(const float* x, int64_t V, double temperature, double min_p, int64_t top_k, double top_p,
                        double u, RowScratch& s) {
  float* z = s.z.data();
  const float t = static_cast<float>(temperature);  // ops.apply_temperature: x / t in float32
  const __m256 vt = _mm256_set1_ps(t), vlowest = _mm256_set1_ps(kLowest);
  __m256 vmax = _mm256_set1_ps(kNegInf);
  int64_t num_finite = 0, i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + i), vt);
    _mm256_storeu_ps(z + i, y);
    vmax = _mm256_max_ps(vmax, y);
    num_finite += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(y, vlowest, _CMP_GE_OQ)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float m = *std::max_element(lanes, lanes + 8);
  for (; i < V; ++i) {
    z[i] = x[i] / t;
    m = std::max(m, z[i]);
    num_finite += z[i] >= kLowest;
  }
  TORCH_CHECK(m > kNegInf, "kvgen.filter_draw: a row has no finite logit");
  bool sparse = false;
  if (min_p > 0.0) {
    const int how = apply_min_p(z, V, m, min_p, num_finite, s);
    if (how == 0) return -1;
    sparse = how == 2;
  }
  if (top_k > 0) sparse = apply_top_k(z, V, top_k, num_finite, sparse, s);
  if (top_p < 1.0) {
    if (!apply_top_p(z, V, m, top_p, sparse, num_finite, s)) return -1;
    sparse = true;
  }
  return sparse ? sparse_draw(s.candidates, m, u) : draw_row(z, V, 1.0f, u, s.block_sums.data());
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

at::Tensor filter_draw(const at::Tensor& logits_in, const at::Tensor& temperature_in, const at::Tensor& min_p_in,
                       const at::Tensor& top_k_in, const at::Tensor& top_p_in, const at::Tensor& u_in) {
  TORCH_CHECK(logits_in.dtype() == at::kFloat && logits_in.dim() == 2 && logits_in.size(1) > 0,
              "kvgen.filter_draw: logits must be float32 [B, V]");
  const int64_t B = logits_in.size(0), V = logits_in.size(1);
  TORCH_CHECK(temperature_in.numel() == B && min_p_in.numel() == B && top_k_in.numel() == B && top_p_in.numel() == B &&
              u_in.numel() == B, "kvgen.filter_draw: temperature, min_p, top_k, top_p and u must be [B=", B, "]");
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor temperature = temperature_in.to(at::kDouble).contiguous(), u = u_in.to(at::kDouble).contiguous();
  const at::Tensor min_p = min_p_in.to(at::kDouble).contiguous(), top_p = top_p_in.to(at::kDouble).contiguous();
  const at::Tensor top_k = top_k_in.to(at::kLong).contiguous();
  const double *tp = temperature.data_ptr<double>(), *up = u.data_ptr<double>();
  const double *mp = min_p.data_ptr<double>(), *pp = top_p.data_ptr<double>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(tp[b] > 0.0 && std::isfinite(tp[b]) && up[b] >= 0.0 && up[b] < 1.0 && mp[b] >= 0.0 && mp[b] <= 1.0 &&
                kp[b] >= 0 && pp[b] > 0.0 && pp[b] <= 1.0, "kvgen.filter_draw: row ", b, " needs temperature > 0, ",
                "u in [0, 1), min_p in [0, 1], top_k >= 0 and top_p in (0, 1]; got ", tp[b], ", ", up[b], ", ", mp[b],
                ", ", kp[b], ", ", pp[b]);
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    RowScratch scratch;
    scratch.z.resize(V);
    scratch.block_sums.resize((V + kDrawBlock - 1) / kDrawBlock);
    for (int64_t b = begin; b < end; ++b)
      op[b] = filter_draw_row(xp + b * V, V, tp[b], mp[b], kp[b], pp[b], up[b], scratch);
  });
  return out;
}

// argmax(x [B, V] f32) -> [B] i64: per row the first index of the largest value, or of the first NaN when the row
// has one (torch.argmax's rule, its twin: NaN counts as the largest); two passes of 8 lanes, rows in parallel.
at::Tensor argmax(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dtype() == at::kFloat && x_in.dim() == 2 && x_in.size(1) > 0, "kvgen.argmax: x must be float32 [B, V]");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* r = xp + b * V;
      __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(r + i);
        vmax = _mm256_max_ps(vmax, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmax);
      float m = *std::max_element(lanes, lanes + 8);
      bool has_nan = _mm256_movemask_ps(nan) != 0;
      for (; i < V; ++i) {
        m = std::max(m, r[i]);
        has_nan |= std::isnan(r[i]);
      }
      int64_t found = 0;
      if (has_nan) {
        while (!std::isnan(r[found])) ++found;
      } else {
        const __m256 vm = _mm256_set1_ps(m);
        for (i = 0; i + 8 <= V; i += 8) {
          const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + i), vm, _CMP_EQ_OQ));
          if (mask) break;
        }
        for (; r[i] != m; ++i) {
        }
        found = i;
      }
      op[b] = found;
    }
  });
  return out;
}

}  // namespace kvgen
