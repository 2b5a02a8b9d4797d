// Causal attention of query rows over cached keys, grouped-query heads, with K and V read
// at fp16 precision (fp16 storage as is; fp32 storage rounded to fp16 on load), so every
// cache kind gives the same numbers. Two entry points share one per-query routine:
//   attention:       q [B, H, T, D], k/v [B, Hkv, S, D] (static / dynamic cache or none);
//                    query t of row b sits at slot past_len + t and sees slots <= it whose
//                    key_mask[b, s] is true (left padding).
//   paged_attention: q [N, H, D] packed over sequences, k/v pools [num_blocks, block_size,
//                    Hkv, D] addressed through block tables (vLLM's PagedAttention).
// Per query the arithmetic depends only on its own visible keys, in order (scores, a
// max, exp, a sum with 8 lanes from the first visible key, then P V in key order), never
// on the batch, the chunking or the padding: greedy tokens agree across all of them.
// Source: Vaswani et al. 2017 eq. 1; Kwon et al. 2023 (paged KV cache); HF repeat_kv.
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

#include "aten_lite.h"
#include "vec_math.h"

namespace kvgen {
namespace {

// 8 values of a K or V row as fp32, rounded to fp16 precision.
inline __m256 load8(const float* p) { return _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(p), _MM_FROUND_TO_NEAREST_INT)); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

struct Scratch {
  std::vector<float> scores;
  std::vector<int64_t> keys;
};

// The G query heads q[g] (D floats each) sharing one KV head attend over the visible
// key positions keys[0..n); krow(p) / vrow(p) give the K / V row of position p.
template <typename T, typename KRow, typename VRow>
void attend_query(const float* const* q, float* const* out, int64_t G, int64_t D, int64_t n, const int64_t* keys,
                  KRow krow, VRow vrow, float scale, Scratch& scratch) {
  const int64_t n8 = (n + 7) / 8 * 8;
  scratch.scores.resize(G * n8);
  float* sc = scratch.scores.data();
  for (int64_t i = 0; i < n; ++i) {
    const T* k = krow(keys[i]);
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), load8(k + d), acc);
      sc[g * n8 + i] = hsum(acc) * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = sc + g * n8;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
    for (int64_t i = n; i < n8; ++i) s[i] = -std::numeric_limits<float>::infinity();
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
      _mm256_storeu_ps(s + i, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum(vsum));
    for (int64_t i = 0; i < n8; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
  }
  // out[g] = sum_i p[g, i] V[keys[i]], 32 output columns held in registers per pass
  for (int64_t g = 0; g < G; ++g) {
    const float* p = sc + g * n8;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const bool full = d0 + 32 <= D;
      for (int64_t i = 0; i < n; ++i) {
        const T* v = vrow(keys[i]) + d0;
        const __m256 w = _mm256_set1_ps(p[i]);
        a0 = _mm256_fmadd_ps(w, load8(v), a0);
        if (full) {
          a1 = _mm256_fmadd_ps(w, load8(v + 8), a1);
          a2 = _mm256_fmadd_ps(w, load8(v + 16), a2);
          a3 = _mm256_fmadd_ps(w, load8(v + 24), a3);
        } else {
          if (d0 + 8 < D) a1 = _mm256_fmadd_ps(w, load8(v + 8), a1);
          if (d0 + 16 < D) a2 = _mm256_fmadd_ps(w, load8(v + 16), a2);
        }
      }
      float* o = out[g] + d0;
      _mm256_storeu_ps(o, a0);
      if (d0 + 8 < D) _mm256_storeu_ps(o + 8, a1);
      if (d0 + 16 < D) _mm256_storeu_ps(o + 16, a2);
      if (d0 + 24 < D) _mm256_storeu_ps(o + 24, a3);
    }
  }
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t D) {
  TORCH_CHECK(q.dtype() == at::kFloat, "kvgen attention: q must be float32");
  TORCH_CHECK(k.dtype() == v.dtype() && (k.dtype() == at::kFloat || k.dtype() == at::kHalf),
              "kvgen attention: k and v must both be float32 or both float16");
  TORCH_CHECK(D % 8 == 0 && q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1,
              "kvgen attention: head_dim must be a multiple of 8 and contiguous");
}

template <typename T>
at::Tensor attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
                          int64_t past_len, float scale) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  const int64_t G = H / Hkv;
  at::Tensor out = at::empty({B, Tq, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Tq * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    scratch.keys.resize(S);
    const float* qs[64];
    float* os[64];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t j = w % Hkv, t = (w / Hkv) % Tq, b = w / (Hkv * Tq);
      const int64_t last = std::min<int64_t>(past_len + t, S - 1);
      const bool* mb = mask ? mask + b * S : nullptr;
      int64_t n = 0;
      for (int64_t s = 0; s <= last; ++s) {
        if (!mb || mb[s]) scratch.keys[n++] = s;
      }
      if (n == 0) scratch.keys[n++] = last;  // a padded query: attend its own slot (finite, unused)
      for (int64_t g = 0; g < G; ++g) {
        qs[g] = qp + b * q.stride(0) + (j * G + g) * q.stride(1) + t * q.stride(2);
        os[g] = op + ((b * Tq + t) * H + j * G + g) * D;
      }
      const T* kb = kp + b * k.stride(0) + j * k.stride(1);
      const T* vb = vp + b * v.stride(0) + j * v.stride(1);
      const int64_t ks = k.stride(2), vs = v.stride(2);
      attend_query<T>(qs, os, G, D, n, scratch.keys.data(), [&](int64_t p) { return kb + p * ks; },
                      [&](int64_t p) { return vb + p * vs; }, scale, scratch);
    }
  });
  return out;
}

template <typename T>
at::Tensor paged_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                      const at::Tensor& qsl, const at::Tensor& seq_lens, float scale) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_pool.size(1), Hkv = k_pool.size(2), G = H / Hkv, R = seq_lens.size(0), nb = tables.size(1);
  at::Tensor out = at::empty({N, H, D}, q.options());
  const int64_t* qslp = qsl.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  std::vector<int64_t> seq_of(N);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(qslp[r + 1] - qslp[r] <= lens[r] && lens[r] <= nb * bs, "kvgen.paged_attention: sequence ", r,
                " has ", lens[r], " positions for ", nb, " blocks");
    for (int64_t i = qslp[r]; i < qslp[r + 1]; ++i) seq_of[i] = r;
  }
  const float* qp = q.data_ptr<float>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t row = Hkv * D;  // elements per slot
  at::parallel_for(0, N * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    const float* qs[64];
    float* os[64];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / Hkv, j = w % Hkv, r = seq_of[i];
      const int64_t pos = lens[r] - (qslp[r + 1] - i);  // this query's position
      const int64_t n = pos + 1;
      scratch.keys.resize(n);
      for (int64_t p = 0; p < n; ++p) scratch.keys[p] = p;
      for (int64_t g = 0; g < G; ++g) {
        qs[g] = qp + i * q.stride(0) + (j * G + g) * q.stride(1);
        os[g] = op + (i * H + j * G + g) * D;
      }
      const int64_t* table = tab + r * nb;
      auto krow = [&](int64_t p) { return kp + (table[p / bs] * bs + p % bs) * row + j * D; };
      auto vrow = [&](int64_t p) { return vp + (table[p / bs] * bs + p % bs) * row + j * D; };
      attend_query<T>(qs, os, G, D, n, scratch.keys.data(), krow, vrow, scale, scratch);
    }
  });
  return out;
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& key_mask,
                     int64_t past_len, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "kvgen.attention: q [B, H, T, D], k/v [B, Hkv, S, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  check_qkv(q, k, v, D);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && H % Hkv == 0 && H / Hkv <= 64,
              "kvgen.attention: shapes q ", q.sizes(), " k ", k.sizes(), " v ", v.sizes());
  TORCH_CHECK(past_len >= 0 && past_len + q.size(2) <= S, "kvgen.attention: past_len ", past_len, " + T exceeds S=", S);
  at::Tensor mask;
  if (key_mask.has_value() && key_mask->defined()) {
    mask = key_mask->to(at::kBool).contiguous();
    TORCH_CHECK(mask.numel() == B * S, "kvgen.attention: key_mask must be [B, S]");
  }
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const float sc = static_cast<float>(scale);
  return k.dtype() == at::kHalf ? attention_impl<at::Half>(q, k, v, mp, past_len, sc)
                                : attention_impl<float>(q, k, v, mp, past_len, sc);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(),
              "kvgen.paged_attention: q [N, H, D], pools [num_blocks, block_size, Hkv, D]");
  check_qkv(q, k_pool, v_pool, q.size(2));
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.size(3) == q.size(2) &&
                  q.size(1) % k_pool.size(2) == 0 && q.size(1) / k_pool.size(2) <= 64,
              "kvgen.paged_attention: pool shape ", k_pool.sizes(), " does not fit q ", q.sizes());
  const at::Tensor tables = block_tables.to(at::kLong).contiguous(), qsl = query_start_loc.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(qsl.numel() == lens.numel() + 1 && tables.size(0) == lens.numel() && qsl[-1].item<int64_t>() == q.size(0),
              "kvgen.paged_attention: query_start_loc / seq_lens / block_tables disagree");
  const float sc = static_cast<float>(scale);
  return k_pool.dtype() == at::kHalf ? paged_impl<at::Half>(q, k_pool, v_pool, tables, qsl, lens, sc)
                                     : paged_impl<float>(q, k_pool, v_pool, tables, qsl, lens, sc);
}

}  // namespace kvgen
