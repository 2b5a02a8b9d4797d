// Causal attention of query rows over cached keys, grouped-query heads, with K and V read
// at fp16 precision (fp16 storage as is; fp32 storage rounded to fp16 on load), so every
// cache kind gives the same numbers; or from int8 storage (static_attention and paged_attention_qkv with k_scale,
// v_scale): each row (a token's K or V in one KV head) as int8 values q and a float32 scale s, the row s q
// (store_row_q8: s = max |x| / 127, q = round(x / s); the scores take s_k after the dot products, the softmax weights
// s_v before P V, attend_chunk). Two entry points share one per-query routine:
//   attention:       q [B, H, T, D], k/v [B, Hkv, S, D] (static / dynamic cache or none);
//                    query t of row b sits at slot past_len + t and sees slots <= it whose
//                    key_mask[b, s] is true (left padding); with window > 0 (a sliding-window layer,
//                    Gemma 3, Mistral) only slots > past_len + t - window of those.
//   static_attention: the same from stacked qkv rows [B*T, (H + 2 Hkv) D] of a layer, after
//                    storing its k, v at slots past_len.. of caches [B, Hkv, S_max, D]
//                    (one op between the projections: the decode step's hot path).
//   paged_attention: q [N, H, D] packed over sequences, k/v pools [num_blocks, Hkv, block_size,
//                    D] addressed through block tables (vLLM's PagedAttention); with window > 0
//                    a query at position p sees positions p - window + 1 .. p. A block holds its heads one
//                    after the other (each head's rows contiguous, as in vLLM's PagedAttention kernels): with the
//                    heads interleaved per slot a head's rows were Hkv D apart, and a decode forward over 2,000
//                    keys (SmolLM2-135M) took 1.25x the static cache's time, 1.18x head-major.
//   paged_attention_qkv: the same from stacked qkv rows [N, (H + 2 Hkv) D], after storing their
//                    k, v at slot_mapping [N] of the pools (the engine step's hot path).
// softcap > 0 (Gemma 2's attn_logit_softcapping): every scaled score s becomes softcap * tanh(s / softcap) before
// the softmax (transformers' eager_attention_forward: after the scale, before the mask); 0 leaves the scores alone.
// sinks [H] float32 (gpt-oss's attention sinks): head h's softmax runs over its scores and one more logit,
// sinks[h], whose probability is then dropped (transformers' GptOss eager_attention_forward), so the weights of the
// keys sum to less than 1: out = sum_k exp(s_k - m) v_k / (sum_k exp(s_k - m) + exp(sinks[h] - m)), m the max of
// all of them.
// When a sequence has one query in the call (a decode step), its K and V rows are prefetched ahead (two 8-key steps
// for K, 8 keys for V, and each chunk's V rows into L2 while its scores are computed): in a paged pool a head's rows
// are contiguous only within a block, and with the KV cache cold (weights stream through the caches between layers)
// paged attention over slots of interleaved heads took 1.8x the static cache's time without it (1.1x with it; 30
// layers, 512 keys, 2 threads). A sequence's several queries (a prefill) share its rows, which stay in cache: there
// prefetching only added instructions (one static attention call of SmolLM2's shape over 512 queries: 6.0 -> 4.8 ms
// without it; 2,048 queries: 102 -> 83 ms).
// Per query the arithmetic depends only on its own visible keys, in order (chunks of 256
// keys, each: scores, a max, exp, a sum with 8 lanes, P V in key order; then the chunks
// merged in order), never on the batch, the prefill chunking, the padding or the threads:
// greedy tokens agree across all of them. Where the CPU has AVX-512 (use_vnni), every chunk runs on 512-bit
// registers holding two of these 8-lane vectors each, bit for bit the same numbers (attend), and consecutive queries
// of a sequence whose keys are the first's and then maybe each next one's own (a group, run_tasks) share one pass
// over them: every K and V vector loaded and converted serves them all, each query's numbers still its own.
// Source: Vaswani et al. 2017 eq. 1; Kwon et al. 2023 (paged KV cache); HF repeat_kv; the window as
// transformers' sliding_window_overlay (kv_idx > q_idx - sliding_window).
#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "aten_lite.h"
#include "common.h"
#include "team.h"
#include "vec_math.h"

namespace kvgen {
namespace {

// 8 values of a K or V row as fp32, rounded to fp16 precision.
inline __m256 load8(const float* p) { return _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(p), _MM_FROUND_TO_NEAREST_INT)); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// int8 storage: the row's values before its scale (applied to the scores and the softmax weights, attend_chunk).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

struct Scratch {
  std::vector<float> scores;
  std::vector<float> row_scales;  // int8 storage: the chunk's keys' K or V scales
  std::vector<int64_t> keys;
  std::vector<float> q;  // the AVX-512 parts' query vectors

  // n 64-byte aligned vectors of 16 floats (contents undefined).
  template <typename V>
  V* wide(size_t n) {
    q.resize(16 * n + 16);
    return reinterpret_cast<V*>((reinterpret_cast<uintptr_t>(q.data()) + 63) & ~uintptr_t{63});
  }
};

// int8 storage's scales: row `key` of K holds k[key] times its int8 values, of V v[key] times its (null for fp32 and
// fp16 storage).
struct RowScales {
  const float* k = nullptr;
  const float* v = nullptr;
};

// 8 dot products (one per vector of a[]) reduced into one vector, lane j = sum of a[j]'s
// lanes, with the same addition tree for every j.
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The dot products of the G heads q[g] with the 8 K rows kr[j], one vector of 8 lanes per (g, j) (summed by hsum8's
// tree later): KB rows a pass, each K vector converted once for all G heads; G KB accumulators hide the FMA latency
// and, with one K vector, fit in 16 registers (KB >= 2 but beyond 6 heads). pass(j0, a) takes a pass's accumulators,
// a[g][j] of row j0 + j.
template <typename T, int G, typename Pass>
__attribute__((always_inline)) inline void qk_passes(const float* const* q, int64_t D, const T* const* kr, Pass pass) {
  constexpr int KB = G == 1 ? 8 : G <= 3 ? 4 : G <= 6 ? 2 : 1;
  for (int j0 = 0; j0 < 8; j0 += KB) {
    __m256 a[G][KB];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < KB; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
      for (int j = 0; j < KB; ++j) {
        const __m256 kv = load8(kr[j0 + j] + d);
        for (int g = 0; g < G; ++g) a[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), kv, a[g][j]);
      }
    pass(j0, a);
  }
}

// The same for any G, one head at a time (each K vector converted G times).
template <typename T>
inline void qk_dots_any(const float* const* q, int64_t G, int64_t D, const T* const* kr, __m256 (*dots)[8]) {
  for (int64_t g = 0; g < G; ++g) {
    for (int j = 0; j < 8; ++j) dots[g][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q[g] + d);
      for (int j = 0; j < 8; ++j) dots[g][j] = _mm256_fmadd_ps(qv, load8(kr[j] + d), dots[g][j]);
    }
  }
}

// The dot vectors of 7 or more heads q[g] with the 8 K rows kr (qk_passes; any G: qk_dots_any).
template <typename T>
inline void qk_dots_g(const float* const* q, int64_t G, int64_t D, const T* const* kr, __m256 (*dots)[8]) {
  const auto store = [dots](int j0, const auto& a) {
    constexpr int KB = sizeof(a[0]) / sizeof(a[0][0]);
    for (size_t g = 0; g < sizeof(a) / sizeof(a[0]); ++g)
      for (int j = 0; j < KB; ++j) dots[g][j0 + j] = a[g][j];
  };
  switch (G) {
    case 7: return qk_passes<T, 7>(q, D, kr, store);  // Qwen2.5-7B; 8: a group of 8 queries of one head (attend)
    case 8: return qk_passes<T, 8>(q, D, kr, store);
    default: return qk_dots_any<T>(q, G, D, kr, dots);
  }
}

// scores[g * n8 + i] = scale * q[g] . K[keys[i]] for i < n, 8 keys at a time: scores_of(kr, sc + i0) writes the G
// heads' scores of the 8 K rows kr (qk_dots and one hsum8 per head; on AVX-512 qk_scores_wide, the same numbers).
// Every path sums a key's products in the same order (d ascending per lane, then hsum8's tree).
// The V rows of the same keys are prefetched into L2 meanwhile: this loop is bound by its arithmetic, P V by
// memory latency, so P V then reads V from L2 (the attention op over 30 layers x 3 KV heads x 3,000 fp16 keys:
// 1 thread 7.0-7.7 -> 6.2-6.6 ms, 2 threads 3.9-4.3 -> 3.6-4.0 ms).
template <typename T, typename KRow, typename VRow, typename Scores>
__attribute__((always_inline)) inline void qk_scores(int64_t D, int64_t n, const int64_t* keys, KRow krow, VRow vrow,
                                                     RowScales rs, float* sc, bool prefetch, Scores scores_of) {
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const T* kr[8];
    for (int j = 0; j < 8; ++j) kr[j] = krow(keys[std::min<int64_t>(i0 + j, n - 1)]);  // the tail repeats a key
    for (int64_t j = i0 + 16; prefetch && j < std::min<int64_t>(i0 + 24, n); ++j) {  // rows two steps ahead
      const char* r = reinterpret_cast<const char*>(krow(keys[j]));
      const char* v = reinterpret_cast<const char*>(vrow(keys[j]));
      for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64) {
        _mm_prefetch(r + b, _MM_HINT_T0);
        _mm_prefetch(v + b, _MM_HINT_T1);
      }
    }
    if (std::is_same_v<T, int8_t> && prefetch && i0 + 16 < n) {  // int8: those rows' scales (16 a line)
      _mm_prefetch(reinterpret_cast<const char*>(rs.k + keys[i0 + 16]), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(rs.v + keys[i0 + 16]), _MM_HINT_T0);
    }
    scores_of(kr, sc + i0);
  }
}

// qk_passes and hsum8 at once for up to 6 heads (KB >= 2): each pass's accumulators go through hsum8's first level
// (hadd of key pairs) in registers, where the dot vectors of qk_dots_g go through memory; hsum8's operations in its
// order (AVX2 prefill attention at G = 3 +2-3 %).
template <typename T, int G>
inline void qk_scores_t(const float* const* q, int64_t D, const T* const* kr, __m256 scale, float* s, int64_t n8) {
  __m256 t[G][4];  // hadd of the dot vectors of keys (0, 1), (2, 3), (4, 5), (6, 7)
  qk_passes<T, G>(q, D, kr, [&t](int j0, const auto& a) {
    constexpr int KB = sizeof(a[0]) / sizeof(a[0][0]);
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < KB; j += 2) t[g][(j0 + j) / 2] = _mm256_hadd_ps(a[g][j], a[g][j + 1]);
  });
  for (int g = 0; g < G; ++g) {
    const __m256 u0 = _mm256_hadd_ps(t[g][0], t[g][1]), u1 = _mm256_hadd_ps(t[g][2], t[g][3]);
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(s + g * n8, _mm256_mul_ps(sum, scale));
  }
}

// scale * hsum8 of the G heads' dot vectors with 8 K rows, stored at s + g n8 (qk_scores_t, or qk_dots_g and hsum8).
template <typename T>
inline void qk_scores8(const float* const* q, int64_t G, int64_t D, const T* const* kr, float scale, float* s,
                       int64_t n8) {
  const __m256 vs = _mm256_set1_ps(scale);
  switch (G) {
    case 1: return qk_scores_t<T, 1>(q, D, kr, vs, s, n8);
    case 2: return qk_scores_t<T, 2>(q, D, kr, vs, s, n8);
    case 3: return qk_scores_t<T, 3>(q, D, kr, vs, s, n8);
    case 4: return qk_scores_t<T, 4>(q, D, kr, vs, s, n8);
    case 5: return qk_scores_t<T, 5>(q, D, kr, vs, s, n8);
    case 6: return qk_scores_t<T, 6>(q, D, kr, vs, s, n8);
    default: break;
  }
  __m256 dots[64][8];
  qk_dots_g<T>(q, G, D, kr, dots);
  for (int64_t g = 0; g < G; ++g) _mm256_storeu_ps(s + g * n8, _mm256_mul_ps(hsum8(dots[g]), vs));
}

// out[g][d0 .. d0 + 8 CW) = sum_i p[g, i] V[keys[i]] in key order, every V vector converted once
// for the G heads; G CW accumulators (>= 8 where G allows) hide the FMA latency and, with the
// G weights and one V vector, fit in 16 registers.
template <typename T, int G, int CW, typename VRow>
void pv_chunk(const float* p, int64_t n8, int64_t n, const int64_t* keys, VRow vrow, int64_t D, int64_t d0,
              float* const* out, bool prefetch, bool add = false) {
  __m256 acc[G][CW];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CW; ++c) acc[g][c] = add ? _mm256_loadu_ps(out[g] + d0 + 8 * c) : _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* v = vrow(keys[i]) + d0;
    if (prefetch && i + 8 < n) {  // the whole row (from L2, see qk_scores)
      const char* r = reinterpret_cast<const char*>(vrow(keys[i + 8]));
      for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
    }
    __m256 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm256_set1_ps(p[g * n8 + i]);
    for (int c = 0; c < CW; ++c) {
      const __m256 vv = load8(v + 8 * c);
      for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], vv, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CW; ++c) _mm256_storeu_ps(out[g] + d0 + 8 * c, acc[g][c]);
}

template <typename T, int G, typename VRow>
void pv(const float* p, int64_t n8, int64_t n, const int64_t* keys, VRow vrow, int64_t D, float* const* out,
        bool prefetch) {
  constexpr int CW = G == 1 ? 8 : G <= 3 ? 4 : 2;  // 8 CW columns per pass
  int64_t d0 = 0;
  for (; d0 + 8 * CW <= D; d0 += 8 * CW) pv_chunk<T, G, CW>(p, n8, n, keys, vrow, D, d0, out, prefetch);
  for (; d0 < D; d0 += 8) pv_chunk<T, G, 1>(p, n8, n, keys, vrow, D, d0, out, prefetch);
}

// pv for the G heads (templates for the common group sizes; one head at a time beyond).
template <typename T, typename VRow>
inline void pv_g(const float* p, int64_t G, int64_t n8, int64_t n, const int64_t* keys, VRow vrow, int64_t D,
                 float* const* out, bool prefetch) {
  switch (G) {
    case 1: return pv<T, 1>(p, n8, n, keys, vrow, D, out, prefetch);
    case 2: return pv<T, 2>(p, n8, n, keys, vrow, D, out, prefetch);
    case 3: return pv<T, 3>(p, n8, n, keys, vrow, D, out, prefetch);
    case 4: return pv<T, 4>(p, n8, n, keys, vrow, D, out, prefetch);
    default:
      for (int64_t g = 0; g < G; ++g) pv<T, 1>(p + g * n8, n8, n, keys, vrow, D, out + g, prefetch);
  }
}

// The same two parts on AVX-512 (Zen 4 and later, Ice Lake and later Xeons; chosen by use_vnni(), common.h), whose
// 512-bit registers hold two of the AVX2 code's 8-lane vectors side by side: qk_scores_wide takes two K rows per
// register (lanes 0-7 one key's, 8-15 the next's, each against the same 8 values of q), pv_chunk_wide two 8-column
// groups of a V row. Each half sees the AVX2 vector's own operations in the same order, so the numbers are bit for
// bit the AVX2 path's, and a core with full-width 512-bit FMAs does twice the work per instruction.
KVGEN_VNNI_BEGIN
// 8 values of each of two K or V rows (lanes 0-7: p0's, 8-15: p1's) as fp32 at fp16 precision: load8(p0), load8(p1).
inline __m512 load8x2(const float* p0, const float* p1) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm256_cvtps_ph(_mm256_loadu_ps(p0), _MM_FROUND_TO_NEAREST_INT)),
      _mm256_cvtps_ph(_mm256_loadu_ps(p1), _MM_FROUND_TO_NEAREST_INT), 1));
}
inline __m512 load8x2(const at::Half* p0, const at::Half* p1) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1));
}
inline __m512 load8x2(const int8_t* p0, const int8_t* p1) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)))));
}
// 16 consecutive values of a V row: load8(p), load8(p + 8).
inline __m512 load16(const float* p) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_loadu_ps(p), _MM_FROUND_TO_NEAREST_INT));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 8 floats in both halves.
inline __m512 twice8(const float* p) {
  const __m256d x = _mm256_castps_pd(_mm256_loadu_ps(p));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(x), x, 1));
}

// vhaddps' operations on each 128-bit block of two registers: [x0 + x1, x2 + x3, y0 + y1, y2 + y3].
inline __m512 hadd512(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

// hsum8 of the 8 keys of key-pair accumulators t = (hadd512(a0, a1), hadd512(a2, a3)), a[p] holding key 2p in lanes
// 0-7 and key 2p + 1 in lanes 8-15: lane j of the result is key j's ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)),
// hsum8's tree, in registers (the dot vectors went through memory to hsum8: ~20 % of a prefill's attention).
inline __m256 hsum8_pairs(__m512 t01, __m512 t23) {
  // u's 128-bit blocks: keys 0, 2, 4, 6 over lanes 0-3 | over lanes 4-7 | keys 1, 3, 5, 7 over lanes 0-3 | 4-7
  const __m512 u = hadd512(t01, t23);
  const __m512i lo = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i hi = _mm512_setr_epi32(4, 12, 5, 13, 6, 14, 7, 15, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm256_add_ps(_mm512_castps512_ps256(_mm512_permutexvar_ps(lo, u)),
                       _mm512_castps512_ps256(_mm512_permutexvar_ps(hi, u)));
}

// qk_scores8 on AVX-512: the 8 keys as 4 pairs (lanes 0-7 one key's, 8-15 the next's), against qd[(d / 8) G + g] =
// q[g][d .. d + 8) in both halves, in one pass over d for up to 6 heads (4 G + 1 of 32 registers), two beyond.
template <typename T, int G>
inline void qk_scores_wide(const __m512* qd, int64_t D, const T* const* kr, __m256 scale, float* s, int64_t n8) {
  constexpr int KP = G <= 6 ? 4 : 2;  // key pairs per pass (6 heads: one accumulator spilled, still 3 % faster than 2)
  __m512 t[G][2];  // hadd512 of the accumulators of key pairs (0, 1) and (2, 3)
  for (int p0 = 0; p0 < 4; p0 += KP) {
    __m512 a[G][KP];
    for (int g = 0; g < G; ++g)
      for (int p = 0; p < KP; ++p) a[g][p] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m512* qv = qd + (d / 8) * G;
      for (int p = 0; p < KP; ++p) {
        const __m512 kv = load8x2(kr[2 * (p0 + p)] + d, kr[2 * (p0 + p) + 1] + d);
        for (int g = 0; g < G; ++g) a[g][p] = _mm512_fmadd_ps(qv[g], kv, a[g][p]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int p = 0; p < KP; p += 2) t[g][(p0 + p) / 2] = hadd512(a[g][p], a[g][p + 1]);
  }
  for (int g = 0; g < G; ++g) _mm256_storeu_ps(s + g * n8, _mm256_mul_ps(hsum8_pairs(t[g][0], t[g][1]), scale));
}

// qk_scores8 on AVX-512 for the G heads q[g] (templates up to 8 heads a KV head: Llama 3 8B has 4, Qwen2.5-1.5B 6,
// Qwen2.5-7B 7; AVX2's qk_scores8 beyond); qd: G D / 8 registers of scratch, filled here.
template <typename T>
inline void qk_scores_wide_g(const float* const* q, int64_t G, int64_t D, const T* const* kr, float scale, float* s,
                             int64_t n8, __m512* qd) {
  const __m256 vs = _mm256_set1_ps(scale);
  switch (G) {
    case 1: return qk_scores_wide<T, 1>(qd, D, kr, vs, s, n8);
    case 2: return qk_scores_wide<T, 2>(qd, D, kr, vs, s, n8);
    case 3: return qk_scores_wide<T, 3>(qd, D, kr, vs, s, n8);
    case 4: return qk_scores_wide<T, 4>(qd, D, kr, vs, s, n8);
    case 5: return qk_scores_wide<T, 5>(qd, D, kr, vs, s, n8);
    case 6: return qk_scores_wide<T, 6>(qd, D, kr, vs, s, n8);
    case 7: return qk_scores_wide<T, 7>(qd, D, kr, vs, s, n8);
    case 8: return qk_scores_wide<T, 8>(qd, D, kr, vs, s, n8);
    default: return qk_scores8<T>(q, G, D, kr, scale, s, n8);
  }
}

// pv_chunk on AVX-512 (no prefetching: a decode step's V rows come from L2, see qk_scores, and a prefetch of them
// into L1 measured no faster): columns d0 .. d0 + 16 CZ of the G heads, two 8-column groups
// per register; add: onto out's values (a group's later queries' last keys, see attend), else from zero.
template <typename T, int G, int CZ, typename VRow>
inline void pv_chunk_wide(const float* p, int64_t n8, int64_t n, const int64_t* keys, VRow vrow, int64_t d0,
                          float* const* out, bool add) {
  __m512 acc[G][CZ];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CZ; ++c) acc[g][c] = add ? _mm512_loadu_ps(out[g] + d0 + 16 * c) : _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* v = vrow(keys[i]) + d0;
    __m512 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm512_set1_ps(p[g * n8 + i]);
    for (int c = 0; c < CZ; ++c) {
      const __m512 vv = load16(v + 16 * c);
      for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(w[g], vv, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CZ; ++c) _mm512_storeu_ps(out[g] + d0 + 16 * c, acc[g][c]);
}

// pv on AVX-512: 16 CZ columns a pass (G CZ + G + 1 of 32 registers), a last 8 as AVX2's pv_chunk; add: see
// pv_chunk_wide.
template <typename T, int G, typename VRow>
inline void pv_wide(const float* p, int64_t n8, int64_t n, const int64_t* keys, VRow vrow, int64_t D, float* const* out,
                    bool add) {
  constexpr int CZ = G <= 6 ? 4 : 2;  // 6 heads (two queries of 3): 24 + 6 + 1 registers, 2-3 % faster than 2
  int64_t d0 = 0;
  for (; d0 + 16 * CZ <= D; d0 += 16 * CZ) pv_chunk_wide<T, G, CZ>(p, n8, n, keys, vrow, d0, out, add);
  for (; d0 + 16 <= D; d0 += 16) pv_chunk_wide<T, G, 1>(p, n8, n, keys, vrow, d0, out, add);
  if (d0 < D) pv_chunk<T, G, 1>(p, n8, n, keys, vrow, D, d0, out, false, add);
}

template <typename T, typename VRow>
inline void pv_wide_g(const float* p, int64_t G, int64_t n8, int64_t n, const int64_t* keys, VRow vrow, int64_t D,
                      float* const* out, bool add) {
  switch (G) {
    case 1: return pv_wide<T, 1>(p, n8, n, keys, vrow, D, out, add);
    case 2: return pv_wide<T, 2>(p, n8, n, keys, vrow, D, out, add);
    case 3: return pv_wide<T, 3>(p, n8, n, keys, vrow, D, out, add);
    case 4: return pv_wide<T, 4>(p, n8, n, keys, vrow, D, out, add);
    case 5: return pv_wide<T, 5>(p, n8, n, keys, vrow, D, out, add);
    case 6: return pv_wide<T, 6>(p, n8, n, keys, vrow, D, out, add);
    case 7: return pv_wide<T, 7>(p, n8, n, keys, vrow, D, out, add);
    case 8: return pv_wide<T, 8>(p, n8, n, keys, vrow, D, out, add);
    default:
      for (int64_t g = 0; g < G; ++g) pv_wide<T, 1>(p + g * n8, n8, n, keys, vrow, D, out + g, add);
  }
}
KVGEN_VNNI_END

// Keys are taken in fixed chunks of kKeyChunk visible keys (flash-decoding): a long context
// gives several tasks that threads share, and since the chunking depends only on a query's
// own visible keys, its arithmetic stays independent of the batch and the thread count.
constexpr int64_t kKeyChunk = 256;
// Below this many visible keys in all (summed over query and KV-head pairs) a call runs on one thread: at 3 KV heads,
// 1 thread beat 2 up to ~128 keys a head (single calls, 6.3 vs 7.6 us at 16 keys; 12.6 vs 12.3 us at 128).
constexpr int64_t kMinParallelKeys = 384;

// s[i] = exp(s[i] - mx) for i < n8; returns their sum in 8 lanes (lane j: s[j] + s[j + 8] + ..., in that order).
inline __m256 exps(float* s, int64_t n8, float mx) {
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return vsum;
}

KVGEN_VNNI_BEGIN
// exps on AVX-512: 16 values a step, their two halves added to the sum one after the other (exps' order). The exps
// were ~10 % of a prefill's attention (2,048 queries, one thread: 53-54 ms, 47-49 without them; 50 with these);
// SmolLM2-135M's 2,048-token prefill 1,462-1,592 -> 1,527-1,626 tokens/s (7 alternating pairs).
inline __m256 exps_wide(float* s, int64_t n8, float mx) {
  const __m512 vmx = _mm512_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n8; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmx));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
    vsum = _mm256_add_ps(vsum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  if (i < n8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return vsum;
}
KVGEN_VNNI_END

// s[h n8 + i] *= f[keys[i]] for the heads' first n values (int8 storage's scales of the chunk's keys).
inline void scale_rows(float* s, int64_t heads, int64_t n8, int64_t n, const int64_t* keys, const float* f,
                       Scratch& scratch) {
  scratch.row_scales.resize(n);
  float* r = scratch.row_scales.data();
  for (int64_t i = 0; i < n; ++i) r[i] = f[keys[i]];
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < n; ++i) s[h * n8 + i] *= r[i];
}

// attend's body (below): scores, their softmax terms, then P V; scores_of(kr, s, n8), exps_of(s, n8, mx) and
// pv_of(p, n8) are the ISA's parts (AVX2's or AVX-512's). With int8 storage (T = int8_t) the scores of the rows' int8
// values are multiplied by the K rows' scales (before the softcap and the max), and the softmax terms, once summed, by
// the V rows' scales (the weights of the V rows' int8 values): q . (s_k k) = s_k (q . k), p (s_v v) = (p s_v) v.
template <typename T, typename KRow, typename VRow, typename Scores, typename Exps, typename PV>
__attribute__((always_inline)) inline void attend_chunk(int64_t G, int64_t num_queries, const int64_t* n_of,
                                                        const int64_t* keys, KRow krow, VRow vrow, RowScales rs,
                                                        int64_t D, float scale, float softcap, bool prefetch,
                                                        Scratch& scratch, float* m, float* l, Scores scores_of,
                                                        Exps exps_of, PV pv_of) {
  const int64_t heads = G * num_queries, n = n_of[num_queries - 1], n8 = (n + 7) / 8 * 8;
  scratch.scores.resize(heads * n8);
  float* sc = scratch.scores.data();
  qk_scores<T>(D, n, keys, krow, vrow, rs, sc, prefetch, [&](const T* const* kr, float* s) { scores_of(kr, s, n8); });
  if constexpr (std::is_same_v<T, int8_t>) scale_rows(sc, heads, n8, n, keys, rs.k, scratch);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = sc + h * n8;
    if (softcap > 0.0f)  // scalar tanh: exact to an ulp, as torch.tanh (a vector tanh loses ~1e-7 near 0)
      for (int64_t i = 0; i < n; ++i) s[i] = softcap * std::tanh(s[i] / softcap);
    for (int64_t i = n_of[h / G]; i < n8; ++i) s[i] = -std::numeric_limits<float>::infinity();  // not its keys
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());  // max is exact in any order
    for (int64_t i = 0; i < n8; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    const float mx = *std::max_element(lanes, lanes + 8);
    m[h] = mx;
    l[h] = hsum(exps_of(s, n8, mx));
  }
  if constexpr (std::is_same_v<T, int8_t>) scale_rows(sc, heads, n8, n, keys, rs.v, scratch);
  pv_of(sc, n8);
}

KVGEN_VNNI_BEGIN
// attend with the AVX-512 parts, compiled for them (the parts as lambdas of this function, as
// the VNNI tiles pass theirs: a lambda of an AVX2 function in between kept them out of line).
template <typename T, typename KRow, typename VRow>
void attend_wide(const float* const* q, int64_t G, int64_t num_queries, int64_t D, const int64_t* n_of,
                 const int64_t* keys, KRow krow, VRow vrow, RowScales rs, float scale, float softcap, bool prefetch,
                 Scratch& scratch, float* m, float* l, float* const* o) {
  const int64_t heads = G * num_queries;
  __m512* qd = scratch.wide<__m512>(heads * D / 8);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < D; d += 8) qd[(d / 8) * heads + h] = twice8(q[h] + d);
  attend_chunk<T>(G, num_queries, n_of, keys, krow, vrow, rs, D, scale, softcap, prefetch, scratch, m, l,
                  [&](const T* const* kr, float* s, int64_t n8) {
                    qk_scores_wide_g<T>(q, heads, D, kr, scale, s, n8, qd);
                  },
                  [](float* s, int64_t n8, float mx) { return exps_wide(s, n8, mx); },
                  [&](const float* p, int64_t n8) {
                    // keys [n_of[k - 1], n_of[k]) for query k's heads and the later queries', onto their sums so far
                    for (int64_t k = 0, lo = 0; k < num_queries; lo = n_of[k++]) {
                      if (k > 0 && n_of[k] == lo) continue;
                      pv_wide_g<T>(p + k * G * n8 + lo, heads - k * G, n8, n_of[k] - lo, keys + lo, vrow, D,
                                   o + k * G, k > 0);
                    }
                  });
}
KVGEN_VNNI_END

// Partial attention of the G query heads q[g] over visible keys keys[0..n) (one chunk):
// m[g] = max score, l[g] = sum exp(score - m[g]), o[g][D] = sum exp(score - m[g]) V (unnormalized).
// The chunks run on the AVX-512 parts where the CPU has them (use_vnni), whose numbers are the AVX2 parts':
// SmolLM2-135M's prefill of 2,048 tokens 1,429-1,515 -> 1,507-1,617 tokens/s, of 512 +1-10 % (alternating processes;
// AMD EPYC, full-width 512-bit FMAs). A decode step's chunks (prefetch true: keys from DRAM) first stayed on AVX2's,
// 1-2 % faster than the first AVX-512 parts; with the scores' hsum8 in registers the AVX-512 parts took 64 sequences'
// decode attention at 512 keys (30 layers) from 35.6-38.6 to 32.2-36.0 ms and the engine (`kvgen bench throughput`)
// from 725-796 to 829-837 tokens/s (2 alternating pairs), one sequence's decode the same within noise.
// A group of queries (run_tasks): q, m, l, o hold num_queries x G heads, query k's G after query
// k - 1's, and query k sees keys [0, n_of[k)) (n_of ascending, n = the last): each K and V vector loaded and converted
// serves them all, and each query's numbers are its own (its scores past n_of[k] masked, its P V stopped there while
// the later queries' goes on from their sums so far, in the same order; AVX2 runs each query's P V alone). A single
// query: num_queries 1, n_of = {n}.
// Pairs of queries and the scores' hsum8 in registers (qk_scores_wide) took SmolLM2-135M's attention op over 2,048
// queries (one thread) from 49.5-51.0 to 35.6-36.5 ms, its 2,048-token prefill from 1,515-1,585 to 1,865-1,957
// tokens/s (4 alternating pairs).
template <typename T, typename KRow, typename VRow>
void attend(const float* const* q, int64_t G, int64_t num_queries, int64_t D, const int64_t* n_of, const int64_t* keys,
            KRow krow, VRow vrow, RowScales rs, float scale, float softcap, bool prefetch, Scratch& scratch, float* m,
            float* l, float* const* o) {
  if (use_vnni())
    return attend_wide<T>(q, G, num_queries, D, n_of, keys, krow, vrow, rs, scale, softcap, prefetch, scratch, m, l, o);
  // AVX2: a group's scores in one pass (each K vector converted once for all its heads), its P V a query at a time
  // (16 registers: the P V templates stop at 4 heads)
  attend_chunk<T>(G, num_queries, n_of, keys, krow, vrow, rs, D, scale, softcap, prefetch, scratch, m, l,
                  [&](const T* const* kr, float* s, int64_t n8) {
                    qk_scores8<T>(q, G * num_queries, D, kr, scale, s, n8);
                  },
                  [](float* s, int64_t n8, float mx) { return exps(s, n8, mx); },
                  [&](const float* p, int64_t n8) {
                    for (int64_t k = 0; k < num_queries; ++k)
                      pv_g<T>(p + k * G * n8, G, n8, n_of[k], keys, vrow, D, o + k * G, prefetch);
                  });
}

// The chunks of every (query, KV head) pair; a chunk's partials are laid out [m G | l G | o G D].
struct Partials {
  int64_t G, D;
  std::vector<int64_t> first;  // first[w] = index of pair w's first chunk; first[num_pairs] = total
  int64_t total_keys = 0;  // visible keys summed over the pairs
  int64_t max_chunks = 0;  // the most chunks of one pair

  Partials(const std::vector<int64_t>& num_keys, int64_t G_, int64_t D_) : G(G_), D(D_), first(num_keys.size() + 1, 0) {
    for (size_t w = 0; w < num_keys.size(); ++w) {
      const int64_t nc = (num_keys[w] + kKeyChunk - 1) / kKeyChunk;
      first[w + 1] = first[w] + nc;
      total_keys += num_keys[w];
      max_chunks = std::max(max_chunks, nc);
    }
  }
  int64_t stride() const { return 2 * G + G * D; }

  // out[g] = softmax-weighted V over the nc chunks of a pair at `chunks` (chunk c at chunks + c stride()), merged in
  // chunk order; sinks: null, or the G heads' sink logits, one more term of each softmax's denominator.
  void merge(int64_t nc, const float* chunks, float* const* out, const float* sinks) const {
    const auto chunk = [&](int64_t c) { return chunks + c * stride(); };
    for (int64_t g = 0; g < G; ++g) {
      float mx = sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < nc; ++c) mx = std::max(mx, chunk(c)[g]);
      float total = sinks ? std::exp(sinks[g] - mx) : 0.0f;
      for (int64_t c = 0; c < nc; ++c) total += chunk(c)[G + g] * std::exp(chunk(c)[g] - mx);
      for (int64_t d = 0; d < D; ++d) out[g][d] = 0.0f;
      for (int64_t c = 0; c < nc; ++c) {
        const float wgt = std::exp(chunk(c)[g] - mx) / total;
        const float* o = chunk(c) + 2 * G + g * D;
        for (int64_t d = 0; d < D; ++d) out[g][d] += o[d] * wgt;
      }
    }
  }
};

// From this many (query, KV head) pairs (a prefill, or a decode step of many sequences), a task is a whole pair:
// its chunks one after the other into a scratch of the thread's, then their merge. Below it (a decode step: few
// pairs, maybe long contexts), a task is one chunk (flash-decoding), all chunks' partials kept until every merge.
// Kept for every chunk of the call, a 4,096-token prefill's partials took 83 MB a layer, written once and read once,
// in pages faulted in afresh each call (static attention over 4,096 queries: 250 -> 148 ms a layer, 2 threads).
constexpr int64_t kMinPairTasks = 64;

// Heads of a group of queries at most (a query's G each), as far as the scores' templates go (qk_scores_wide_g,
// qk_dots_g). The attention op over 1,024 queries, one thread, GFLOP/s with groups of at most 2 / 4 / 8 heads, on
// AVX-512: G = 1 (16 heads) 73 / 104 / 107 (47 one query a pass); G = 2 84 / 114 / 114; G = 3 (SmolLM2) 100 / 104 /
// 125. On AVX2 (16 registers, P V a query at a time; 6 heads keep their scores' hsum8 in registers, qk_scores_t):
// G = 1 51 -> 56 / 60 / 64-65, 67 at 6; G = 2 68-70 -> 74-75 at 6; G = 3 84-85 -> 81 at 6 and 8, so it stays single.
constexpr int64_t kMaxGroupHeads = 8, kMaxGroupHeadsAvx2 = 6;

// Runs every chunk of `parts` and merges each pair's chunks into its outputs, in parallel.
// run_chunk(ws, count, c, scratch, m, l, o) computes chunk c of the count pairs ws[0 .. count) in one pass (a group,
// see attend; count 1: one pair): m, l, o hold their G heads each, one pair's after the other's. twin(w) names the
// pair whose visible keys are w's and then maybe its query's own (the next query of w's sequence at the same KV head,
// no sliding window cut between them), or -1; a chain of twins is a group, and each chunk of a pair is then the start
// of its twin's same chunk (the twin may have one chunk more: chunk c runs for the group's pairs that have it, the
// last ones). A prefill's groups (up to kMaxGroupHeads heads; on AVX2 6, where G <= 2) share every K vector loaded
// and converted, and on AVX-512 every V vector too. out_ptrs(w, out) gives pair w's outputs; sinks: null or
// [H] (pair w's KV head is w % Hkv, its query heads (w % Hkv) G .. + G - 1). Each thread claims the next task as it
// finishes one: a prefill's later queries see more keys, and equal contiguous shares of the task list (parallel_for's
// split) left one thread with ~60 % of the work at 512 queries.
template <typename RunChunk, typename OutPtrs, typename Twin>
void run_tasks(const Partials& parts, int64_t num_pairs, RunChunk run_chunk, OutPtrs out_ptrs, const float* sinks,
               int64_t Hkv, Twin twin) {
  const int64_t G = parts.G, D = parts.D, stride = parts.stride(), num_chunks = parts.first.back();
  const auto set_outputs = [&](float* chunk, float** os) {
    for (int64_t g = 0; g < G; ++g) os[g] = chunk + 2 * G + g * D;
  };
  std::atomic<int64_t> next{0};
  if (num_pairs >= kMinPairTasks) {
    // a task: the pairs order[starts[k] .. starts[k + 1]), a chain of twins
    const int64_t max_group = use_vnni() ? std::max<int64_t>(1, kMaxGroupHeads / G)
                                         : G <= 2 ? kMaxGroupHeadsAvx2 / G : 1;
    std::vector<int64_t> order, starts;
    order.reserve(num_pairs);
    std::vector<char> is_taken(num_pairs, 0);
    for (int64_t w = 0; w < num_pairs; ++w) {
      if (is_taken[w]) continue;
      starts.push_back(static_cast<int64_t>(order.size()));
      int64_t p = w;
      for (int64_t k = 0; k < max_group && p >= 0 && !is_taken[p]; ++k) {
        is_taken[p] = 1;
        order.push_back(p);
        p = k + 1 < max_group ? twin(p) : -1;  // (no twin looked up past a full group)
      }
    }
    starts.push_back(num_pairs);
    const int64_t num_tasks = static_cast<int64_t>(starts.size()) - 1;
    parallel_for(0, std::min<int64_t>(num_tasks, num_threads()), 1, [&](int64_t, int64_t) {
      Scratch scratch;
      std::vector<float> chunks(max_group * parts.max_chunks * stride);
      float* os[64];
      float m[64], l[64];
      for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
        const int64_t task = num_tasks - 1 - k;  // the later queries (more keys) first, so the last tasks are short
        const int64_t* ws = order.data() + starts[task];
        const int64_t count = starts[task + 1] - starts[task];
        const auto nc = [&](int64_t i) { return parts.first[ws[i] + 1] - parts.first[ws[i]]; };
        const auto chunk_of = [&](int64_t i, int64_t c) { return chunks.data() + (i * parts.max_chunks + c) * stride; };
        for (int64_t c = 0, i0 = 0; c < nc(count - 1); ++c) {
          while (nc(i0) <= c) ++i0;  // the pairs with a chunk c: the last ones (later queries see as many keys or more)
          for (int64_t i = i0; i < count; ++i) set_outputs(chunk_of(i, c), os + (i - i0) * G);
          run_chunk(ws + i0, count - i0, c, scratch, m, l, os);
          for (int64_t i = i0; i < count; ++i) {
            std::copy(m + (i - i0) * G, m + (i - i0 + 1) * G, chunk_of(i, c));
            std::copy(l + (i - i0) * G, l + (i - i0 + 1) * G, chunk_of(i, c) + G);
          }
        }
        for (int64_t i = 0; i < count; ++i) {
          out_ptrs(ws[i], os);
          parts.merge(nc(i), chunk_of(i, 0), os, sinks ? sinks + (ws[i] % Hkv) * G : nullptr);
        }
      }
    });
    return;
  }
  // Few keys in all (a decode step over a short context): one thread, as waking the others costs more than it saves.
  const int64_t num_workers = parts.total_keys < kMinParallelKeys ? 1 : std::min<int64_t>(num_chunks, num_threads());
  std::vector<float> data(num_chunks * stride);
  parallel_for(0, std::max<int64_t>(num_workers, 1), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    float* os[64];
    int64_t w = 0;
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < num_chunks;) {
      while (parts.first[w + 1] <= task) ++w;  // tasks are claimed in increasing order
      float* chunk = data.data() + task * stride;
      set_outputs(chunk, os);
      run_chunk(&w, 1, task - parts.first[w], scratch, chunk, chunk + G, os);
    }
  });
  parallel_for(0, num_pairs, 16, [&](int64_t begin, int64_t end) {
    float* os[64];
    for (int64_t w = begin; w < end; ++w) {
      out_ptrs(w, os);
      parts.merge(parts.first[w + 1] - parts.first[w], data.data() + parts.first[w] * stride, os,
                  sinks ? sinks + (w % Hkv) * G : nullptr);
    }
  });
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t D) {
  TORCH_CHECK(q.dtype() == at::kFloat, "kvgen attention: q must be float32");
  TORCH_CHECK(k.dtype() == v.dtype() && (k.dtype() == at::kFloat || k.dtype() == at::kHalf),
              "kvgen attention: k and v must both be float32 or both float16");
  TORCH_CHECK(D % 8 == 0 && q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1,
              "kvgen attention: head_dim must be a multiple of 8 and contiguous");
}

// Raw operands of `attention`: element strides of q [B, H, T, D], k / v [B, Hkv, S, D];
// out is [B, T, H, D] contiguous; mask [B, S] or null.
template <typename T>
struct AttentionArgs {
  const float* q;
  int64_t q_b, q_h, q_t;
  const T* k;
  int64_t k_b, k_h, k_s;
  const T* v;
  int64_t v_b, v_h, v_s;
  float* out;
  int64_t B, H, Tq, D, Hkv, S;
  const bool* mask;
  int64_t past_len;
  float scale;
  int64_t window;  // 0: every earlier slot; else the last `window` slots up to the query's own
  float softcap;   // 0: none; else scores -> softcap * tanh(score / softcap)
  const float* sinks;  // null, or [H] sink logits
  const float* k_scale = nullptr;  // int8 storage: the rows' scales [B, Hkv, S_cap] contiguous (RowScales)
  const float* v_scale = nullptr;
  int64_t S_cap = 0;
};

template <typename T>
void attention_impl(const AttentionArgs<T>& a) {
  const int64_t G = a.H / a.Hkv, num_pairs = a.B * a.Tq * a.Hkv;  // pair w = ((b * Tq) + t) * Hkv + j
  // visible keys of query (b, t): slots <= past_len + t allowed by the mask (at least its own);
  // before[b (S + 1) + s] = slots of row b before s that the mask allows
  std::vector<int64_t> before(a.mask ? a.B * (a.S + 1) : 0);
  for (int64_t b = 0; a.mask && b < a.B; ++b)
    for (int64_t s = 0; s < a.S; ++s) before[b * (a.S + 1) + s + 1] = before[b * (a.S + 1) + s] + a.mask[b * a.S + s];
  // first visible slot of query t (sliding window; 0 without one); its mask-allowed keys are those after it
  const auto first_slot = [&](int64_t t) {
    return a.window > 0 ? std::max<int64_t>(0, a.past_len + t - a.window + 1) : int64_t{0};
  };
  std::vector<int64_t> num_keys(num_pairs);
  std::vector<char> has_keys(a.B * a.Tq);  // a padded query has none (it reads its own slot, unused)
  for (int64_t bt = 0; bt < a.B * a.Tq; ++bt) {
    const int64_t b = bt / a.Tq, t = bt % a.Tq, last = std::min<int64_t>(a.past_len + t, a.S - 1);
    const int64_t first = std::min(first_slot(t), last), r = b * (a.S + 1);
    const int64_t n = a.mask ? before[r + last + 1] - before[r + first] : last + 1 - first;
    for (int64_t j = 0; j < a.Hkv; ++j) num_keys[bt * a.Hkv + j] = std::max<int64_t>(n, 1);
    has_keys[bt] = n > 0;
  }
  Partials parts(num_keys, G, a.D);
  std::vector<int64_t> slots(a.mask ? 0 : a.S);  // slots[s] = s: the keys of a chunk without a mask, as a view
  std::iota(slots.begin(), slots.end(), int64_t{0});
  auto run_chunk = [&](const int64_t* ws, int64_t count, int64_t c, Scratch& scratch, float* m, float* l,
                       float* const* o) {
    const int64_t kw = ws[count - 1];  // the pair whose keys the pass reads (the others' are their starts)
    const int64_t j = kw % a.Hkv, t = (kw / a.Hkv) % a.Tq, b = kw / (a.Hkv * a.Tq);
    const int64_t last = std::min<int64_t>(a.past_len + t, a.S - 1), lo = c * kKeyChunk;
    const int64_t first = std::min(first_slot(t), last), hi = std::min<int64_t>(num_keys[kw], lo + kKeyChunk);
    const int64_t* keys = slots.data() + first + lo;  // no mask: every slot first .. its own
    int64_t n = hi - lo;
    if (a.mask) {
      scratch.keys.clear();
      if (const int64_t* row = before.data() + b * (a.S + 1); row[last + 1] > row[first]) {
        // the visible keys lo .. hi - 1 after `first`, from the slot of the (row[first] + lo)-th visible one
        const int64_t from = row[first] + lo;
        for (int64_t s = std::upper_bound(row, row + last + 2, from) - row - 1; s <= last && int64_t(scratch.keys.size()) < hi - lo; ++s)
          if (a.mask[b * a.S + s]) scratch.keys.push_back(s);
      }
      if (scratch.keys.empty()) scratch.keys.push_back(last);  // a padded query: its own slot (finite, unused)
      keys = scratch.keys.data(), n = static_cast<int64_t>(scratch.keys.size());
    }
    const float* qs[64];
    int64_t n_of[64];
    for (int64_t i = 0; i < count; ++i) {
      n_of[i] = i + 1 < count ? std::min<int64_t>(num_keys[ws[i]], lo + kKeyChunk) - lo : n;
      const float* qt = a.q + b * a.q_b + (ws[i] / a.Hkv % a.Tq) * a.q_t;  // pair ws[i]'s query row
      for (int64_t g = 0; g < G; ++g) qs[i * G + g] = qt + (j * G + g) * a.q_h;
    }
    const T* kb = a.k + b * a.k_b + j * a.k_h;
    const T* vb = a.v + b * a.v_b + j * a.v_h;
    const int64_t ks = a.k_s, vs = a.v_s, head = (b * a.Hkv + j) * a.S_cap;
    const RowScales rs = a.k_scale ? RowScales{a.k_scale + head, a.v_scale + head} : RowScales{};
    attend<T>(qs, G, count, a.D, n_of, keys, [&](int64_t p) { return kb + p * ks; },
              [&](int64_t p) { return vb + p * vs; }, rs, a.scale, a.softcap, a.Tq == 1, scratch, m, l, o);
  };
  // query t's twin: t + 1 of the same row, when neither a sliding window nor padding sets their keys apart
  const auto twin = [&](int64_t w) -> int64_t {
    const int64_t bt = w / a.Hkv, t = bt % a.Tq;
    return t + 1 < a.Tq && first_slot(t) == first_slot(t + 1) && has_keys[bt] ? w + a.Hkv : -1;
  };
  run_tasks(parts, num_pairs, run_chunk, [&](int64_t w, float** os) {
    const int64_t j = w % a.Hkv, bt = w / a.Hkv;
    for (int64_t g = 0; g < G; ++g) os[g] = a.out + (bt * a.H + j * G + g) * a.D;
  }, a.sinks, a.Hkv, twin);
}

template <typename T>
at::Tensor attention_tensors(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
                             int64_t past_len, float scale, int64_t window, float softcap, const float* sinks) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, Tq, H, D}, q.options());
  attention_impl<T>({q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr<T>(), k.stride(0), k.stride(1),
                     k.stride(2), v.data_ptr<T>(), v.stride(0), v.stride(1), v.stride(2), out.data_ptr<float>(), B, H, Tq, D,
                     k.size(1), k.size(2), mask, past_len, scale, window, softcap, sinks});
  return out;
}

// Store n fp32 values (n % 8 == 0) as T: fp16 rounded to nearest even, as Tensor.to(float16).
template <typename T>
inline void store_row(T* y, const float* x, int64_t n) {
  for (int64_t d = 0; d < n; d += 8) {
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(y + d, _mm256_loadu_ps(x + d));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + d), _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
    }
  }
}

// Store n fp32 values (n % 8 == 0) as int8 q and their scale: scale = amax / 127 and q = round(x * (127 / amax))
// (nearest even; 0 where amax is 0), amax the largest |x| (symmetric per-row quantization, as the torch reference,
// whose values and scales are the same to the bit).
inline void store_row_q8(int8_t* y, float* scale, const float* x, int64_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + d), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  const float amax = *std::max_element(lanes, lanes + 8);
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  *scale = amax / 127.0f;
  for (int64_t d = 0; d < n; d += 8) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + d), inv));  // |q| <= 127
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));  // 8 x int16
    _mm_storel_epi64(reinterpret_cast<__m128i*>(y + d), _mm_packs_epi16(w, w));
  }
}

// Store a row of k or v: T's (store_row), or with int8 storage its int8 values and, at *scale, its scale.
template <typename T>
inline void store_kv_row(T* y, float* scale, const float* x, int64_t n) {
  if constexpr (std::is_same_v<T, int8_t>) {
    store_row_q8(y, scale, x, n);
  } else {
    store_row(y, x, n);
  }
}

// Write rows [B*T, Hkv*D] of fp32 k (or v) into a cache [B, Hkv, S_max, D] at slots past_len.. (int8 storage: and
// their scales into scales [B, Hkv, S_max] contiguous; else scales is null).
template <typename T>
void store_rows(const float* src, int64_t src_stride, T* cache, int64_t c_b, int64_t c_h, int64_t c_s, float* scales,
                int64_t B, int64_t Tq, int64_t Hkv, int64_t S_max, int64_t D, int64_t past_len) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tq; ++t)
      for (int64_t j = 0; j < Hkv; ++j)
        store_kv_row(cache + b * c_b + j * c_h + (past_len + t) * c_s,
                     scales ? scales + (b * Hkv + j) * S_max + past_len + t : nullptr,
                     src + (b * Tq + t) * src_stride + j * D, D);
}

// k_scale, v_scale: int8 storage's scales [B, Hkv, S_max] float32 contiguous, else null.
template <typename T>
at::Tensor static_impl(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, float* k_scale, float* v_scale,
                       const bool* mask, int64_t past_len, int64_t H, float scale, int64_t window, float softcap,
                       const float* sinks) {
  const int64_t B = k_cache.size(0), Hkv = k_cache.size(1), S_max = k_cache.size(2), D = k_cache.size(3);
  const int64_t N = qkv.size(0), Tq = N / B, W = qkv.size(1);
  const float* base = qkv.data_ptr<float>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  store_rows<T>(base + H * D, W, kc, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_scale, B, Tq, Hkv,
                S_max, D, past_len);
  store_rows<T>(base + (H + Hkv) * D, W, vc, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_scale, B, Tq,
                Hkv, S_max, D, past_len);
  at::Tensor out = at::empty({N, H * D}, qkv.options());
  // q of row (b, t), head h sits at base + (b T + t) W + h D
  attention_impl<T>({base, Tq * W, D, W, kc, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), vc, v_cache.stride(0),
                     v_cache.stride(1), v_cache.stride(2), out.data_ptr<float>(), B, H, Tq, D, Hkv, past_len + Tq, mask,
                     past_len, scale, window, softcap, sinks, k_scale, v_scale, S_max});
  return out;
}

// paged_attention over q rows at qp + i q_n + h q_h (h < H, D contiguous floats); out [N, H*D]. tables [R, nb],
// qsl [R + 1], lens [R] int64 contiguous (checked by the callers). rs: int8 storage's scales, pools [num_blocks, Hkv,
// block_size] (row r of the pools' [num_blocks * Hkv * block_size, D] has scale rs.k[r], rs.v[r]).
template <typename T>
at::Tensor paged_impl(const float* qp, int64_t q_n, int64_t q_h, int64_t N, int64_t H, const at::Tensor& k_pool,
                      const at::Tensor& v_pool, RowScales rs, const at::Tensor& tables, const at::Tensor& qsl,
                      const at::Tensor& seq_lens, float scale, int64_t window, float softcap, const float* sinks,
                      const at::TensorOptions& options) {
  const int64_t D = k_pool.size(3), bs = k_pool.size(2), Hkv = k_pool.size(1), G = H / Hkv, R = seq_lens.size(0);
  const int64_t nb = tables.size(1);
  at::Tensor out = at::empty({N, H * D}, options);
  const int64_t* qslp = qsl.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  TORCH_CHECK(qslp[0] == 0 && qslp[R] == N, "kvgen.paged_attention: query_start_loc must run from 0 to N=", N);
  std::vector<int64_t> seq_of(N);
  const int64_t num_blocks = k_pool.size(0);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(qslp[r] <= qslp[r + 1] && qslp[r + 1] - qslp[r] <= lens[r] && lens[r] <= nb * bs,
                "kvgen.paged_attention: sequence ", r, " has ", lens[r], " positions for ", nb, " blocks");
    for (int64_t b = 0; b < (lens[r] + bs - 1) / bs; ++b) {  // the blocks it reads (entries past them are padding)
      TORCH_CHECK(0 <= tab[r * nb + b] && tab[r * nb + b] < num_blocks, "kvgen.paged_attention: sequence ", r,
                  " reads block ", tab[r * nb + b], " outside the pool of ", num_blocks);
    }
    for (int64_t i = qslp[r]; i < qslp[r + 1]; ++i) seq_of[i] = r;
  }
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  float* op = out.data_ptr<float>();
  // pair w = i * Hkv + j: query i sees positions first_i .. pos_i (first_i = pos_i - window + 1 with a window, else 0)
  std::vector<int64_t> num_keys(N * Hkv);
  for (int64_t w = 0; w < N * Hkv; ++w) {
    const int64_t i = w / Hkv, r = seq_of[i], seen = lens[r] - (qslp[r + 1] - i) + 1;
    num_keys[w] = window > 0 ? std::min(seen, window) : seen;
  }
  Partials parts(num_keys, G, D);
  // pos_i + 1 - its number of keys: query i's first visible position
  const auto first_of = [&](int64_t w) {
    const int64_t i = w / Hkv, r = seq_of[i];
    return lens[r] - (qslp[r + 1] - i) + 1 - num_keys[w];
  };
  auto run_chunk = [&](const int64_t* ws, int64_t count, int64_t c, Scratch& scratch, float* m, float* l,
                       float* const* o) {
    const int64_t kw = ws[count - 1];  // the pair whose keys the pass reads (the others' are their starts)
    const int64_t i = kw / Hkv, j = kw % Hkv, r = seq_of[i], lo = c * kKeyChunk;
    const int64_t hi = std::min<int64_t>(num_keys[kw], lo + kKeyChunk), first = first_of(kw);
    // each key's row in the pools (block, head, slot), walked block by block: no division by the block size
    // per key and row (K, V and their prefetches); engine decode steps at 1-16 sequences measured the same or ~5 %
    // faster
    scratch.keys.resize(hi - lo);
    const int64_t* table = tab + r * nb;
    for (int64_t p = first + lo, n = 0; n < hi - lo;) {
      const int64_t block = p / bs, slot = p % bs, run = std::min(bs - slot, hi - lo - n);
      const int64_t row = (table[block] * Hkv + j) * bs + slot;
      for (int64_t s = 0; s < run; ++s) scratch.keys[n + s] = row + s;
      p += run, n += run;
    }
    const float* qs[64];
    int64_t n_of[64];
    for (int64_t k = 0; k < count; ++k) {
      n_of[k] = std::min<int64_t>(num_keys[ws[k]], lo + kKeyChunk) - lo;
      for (int64_t g = 0; g < G; ++g) qs[k * G + g] = qp + (ws[k] / Hkv) * q_n + (j * G + g) * q_h;
    }
    auto krow = [&](int64_t row) { return kp + row * D; };
    auto vrow = [&](int64_t row) { return vp + row * D; };
    const bool prefetch = qslp[r + 1] - qslp[r] == 1;  // a decode step's keys are cold; a prefill's, shared and hot
    attend<T>(qs, G, count, D, n_of, scratch.keys.data(), krow, vrow, rs, scale, softcap, prefetch, scratch, m, l, o);
  };
  // query i's twin: i + 1 of the same sequence, when no sliding window sets their first keys apart
  const auto twin = [&](int64_t w) -> int64_t {
    const int64_t i = w / Hkv;
    return i + 1 < qslp[seq_of[i] + 1] && first_of(w) == first_of(w + Hkv) ? w + Hkv : -1;
  };
  run_tasks(parts, N * Hkv, run_chunk, [&](int64_t w, float** os) {
    const int64_t i = w / Hkv, j = w % Hkv;
    for (int64_t g = 0; g < G; ++g) os[g] = op + (i * H + j * G + g) * D;
  }, sinks, Hkv, twin);
  return out;
}

void check_paged(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables, const at::Tensor& qsl,
                 const at::Tensor& lens, int64_t H, int64_t D) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.dtype() == v_pool.dtype() &&
                  (k_pool.dtype() == at::kFloat || k_pool.dtype() == at::kHalf || k_pool.dtype() == at::kChar) &&
                  k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.size(3) == D && D % 8 == 0 && k_pool.size(1) >= 1 &&
                  k_pool.size(2) >= 1 && H >= 1 && H % k_pool.size(1) == 0 && H / k_pool.size(1) <= 64,
              "kvgen.paged_attention: contiguous float16/float32/int8 pools [num_blocks, Hkv, block_size, D] ", k_pool.sizes(),
              " do not fit ", H, " heads of ", D);
  TORCH_CHECK(tables.dim() == 2 && qsl.dim() == 1 && lens.dim() == 1 && qsl.numel() == lens.numel() + 1 &&
                  tables.size(0) == lens.numel(),
              "kvgen.paged_attention: query_start_loc [R+1] / seq_lens [R] / block_tables [R, nb] disagree");
}

// int8 storage's scales of caches k, v [..., D] int8: k_scale and v_scale, float32 contiguous, one per row
// ([...] = k.sizes() without D); both null (none given) for float32 and float16 caches.
std::pair<float*, float*> row_scales(const at::Tensor& k, const c10::optional<at::Tensor>& k_scale,
                                     const c10::optional<at::Tensor>& v_scale, const char* op) {
  const bool given = k_scale.has_value() && k_scale->defined(), v_given = v_scale.has_value() && v_scale->defined();
  TORCH_CHECK(given == v_given && given == (k.dtype() == at::kChar), "kvgen.", op, ": int8 caches take k_scale and "
              "v_scale (one float32 per row), float16 and float32 caches neither");
  if (!given) return {nullptr, nullptr};
  for (const at::Tensor* t : {&*k_scale, &*v_scale})
    TORCH_CHECK(t->dtype() == at::kFloat && t->is_contiguous() && t->sizes() == k.sizes().slice(0, k.dim() - 1) &&
                    k.is_contiguous(),
                "kvgen.", op, ": k_scale and v_scale must be contiguous float32 ", k.sizes().slice(0, k.dim() - 1),
                " beside contiguous int8 caches, got ", t->sizes());
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
}

// The sink logits [H] as contiguous float32 (kept alive in `holder`), or null without them.
const float* sink_logits(const c10::optional<at::Tensor>& sinks, int64_t H, at::Tensor& holder, const char* op) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  holder = sinks->to(at::kFloat).contiguous();
  TORCH_CHECK(holder.dim() == 1 && holder.numel() == H, "kvgen.", op, ": sinks must be [H] = [", H, "], got ",
              sinks->sizes());
  return holder.data_ptr<float>();
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& key_mask,
                     int64_t past_len, double scale, int64_t window, double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "kvgen.attention: q [B, H, T, D], k/v [B, Hkv, S, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  check_qkv(q, k, v, D);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && Hkv >= 1 && H % Hkv == 0 && H / Hkv <= 64,
              "kvgen.attention: shapes q ", q.sizes(), " k ", k.sizes(), " v ", v.sizes());
  TORCH_CHECK(past_len >= 0 && past_len + q.size(2) <= S, "kvgen.attention: past_len ", past_len, " + T exceeds S=", S);
  TORCH_CHECK(window >= 0, "kvgen.attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "kvgen.attention: softcap must be >= 0 (0: none), got ", softcap);
  at::Tensor mask;
  if (key_mask.has_value() && key_mask->defined()) {
    mask = key_mask->to(at::kBool).contiguous();
    TORCH_CHECK(mask.numel() == B * S, "kvgen.attention: key_mask must be [B, S]");
  }
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const float sc = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);
  at::Tensor held;
  const float* sk = sink_logits(sinks, H, held, "attention");
  return k.dtype() == at::kHalf ? attention_tensors<at::Half>(q, k, v, mp, past_len, sc, window, cap, sk)
                                : attention_tensors<float>(q, k, v, mp, past_len, sc, window, cap, sk);
}

at::Tensor static_attention(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& key_mask, int64_t past_len, int64_t num_heads, double scale,
                            int64_t window, double softcap, const c10::optional<at::Tensor>& sinks,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(window >= 0, "kvgen.static_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "kvgen.static_attention: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.dtype() == at::kFloat && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == v_cache.dtype() &&
                  (k_cache.dtype() == at::kHalf || k_cache.dtype() == at::kFloat || k_cache.dtype() == at::kChar) &&
                  k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "kvgen.static_attention: qkv float32 [B*T, W] contiguous, caches [B, Hkv, S_max, D] float16/float32/int8");
  const auto [ks, vs] = row_scales(k_cache, k_scale, v_scale, "static_attention");
  const int64_t B = k_cache.size(0), Hkv = k_cache.size(1), S_max = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(B >= 1 && Hkv >= 1 && num_heads >= 1, "kvgen.static_attention: caches ", k_cache.sizes(),
              " need B >= 1 and Hkv >= 1, and num_heads >= 1, got ", num_heads);  // (N / B, H % Hkv below)
  const int64_t N = qkv.size(0), T = N / B, H = num_heads;
  TORCH_CHECK(N == B * T && qkv.size(1) == (H + 2 * Hkv) * D && D % 8 == 0 && H % Hkv == 0 && H / Hkv <= 64,
              "kvgen.static_attention: qkv ", qkv.sizes(), " does not fit caches ", k_cache.sizes(), " with ", H, " heads");
  TORCH_CHECK(past_len >= 0 && past_len + T <= S_max, "kvgen.static_attention: writing slots up to ", past_len + T,
              " overflows a cache of ", S_max);
  at::Tensor mask;
  if (key_mask.has_value() && key_mask->defined()) {
    mask = key_mask->to(at::kBool).contiguous();
    TORCH_CHECK(mask.size(0) == B && mask.numel() == B * (past_len + T), "kvgen.static_attention: key_mask must be [B, S]");
  }
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const float sc = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);
  at::Tensor held;
  const float* sk = sink_logits(sinks, H, held, "static_attention");
  if (ks) return static_impl<int8_t>(qkv, k_cache, v_cache, ks, vs, mp, past_len, H, sc, window, cap, sk);
  return k_cache.dtype() == at::kHalf
             ? static_impl<at::Half>(qkv, k_cache, v_cache, nullptr, nullptr, mp, past_len, H, sc, window, cap, sk)
             : static_impl<float>(qkv, k_cache, v_cache, nullptr, nullptr, mp, past_len, H, sc, window, cap, sk);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           double scale, int64_t window, double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0, "kvgen.paged_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "kvgen.paged_attention: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(q.dim() == 3, "kvgen.paged_attention: q [N, H, D], pools [num_blocks, Hkv, block_size, D]");
  check_qkv(q, k_pool, v_pool, q.size(2));
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &seq_lens}) {  // a float block id would be truncated
    TORCH_CHECK(c10::isIntegralType(t->scalar_type(), /*includeBool=*/false),
                "kvgen.paged_attention: block_tables, query_start_loc and seq_lens must be integer tensors, got ",
                t->scalar_type());
  }
  const at::Tensor tables = block_tables.to(at::kLong).contiguous(), qsl = query_start_loc.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  check_paged(k_pool, v_pool, tables, qsl, lens, q.size(1), q.size(2));
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const float* qp = q.data_ptr<float>();
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  at::Tensor held;
  const float* sk = sink_logits(sinks, H, held, "paged_attention");
  const at::Tensor out = k_pool.dtype() == at::kHalf
      ? paged_impl<at::Half>(qp, q.stride(0), q.stride(1), N, H, k_pool, v_pool, {}, tables, qsl, lens, sc, window,
                             cap, sk, q.options())
      : paged_impl<float>(qp, q.stride(0), q.stride(1), N, H, k_pool, v_pool, {}, tables, qsl, lens, sc, window, cap,
                          sk, q.options());
  return out.view({N, H, D});
}

// Stores k, v of every row at its slot, then attends from the q heads of the same rows: no tensor is made but the
// output, and the index tensors are read as they are (int64, contiguous: what the engine passes).
at::Tensor paged_attention_qkv(const at::Tensor& qkv, at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slot_mapping,
                               const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                               const at::Tensor& seq_lens, int64_t num_heads, double scale, int64_t window,
                               double softcap, const c10::optional<at::Tensor>& sinks,
                               const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(window >= 0, "kvgen.paged_attention_qkv: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "kvgen.paged_attention_qkv: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.dtype() == at::kFloat,
              "kvgen.paged_attention_qkv: qkv float32 [N, (H + 2 Hkv) D] contiguous");
  for (const at::Tensor* t : {&slot_mapping, &block_tables, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->dtype() == at::kLong && t->is_contiguous(),
                "kvgen.paged_attention_qkv: slot_mapping, block_tables, query_start_loc, seq_lens must be contiguous int64");
  const int64_t N = qkv.size(0), H = num_heads, D = k_pool.dim() == 4 ? k_pool.size(3) : 0;
  check_paged(k_pool, v_pool, block_tables, query_start_loc, seq_lens, H, D);
  const int64_t Hkv = k_pool.size(1), bs = k_pool.size(2), W = qkv.size(1), num_slots = k_pool.size(0) * bs;
  TORCH_CHECK(W == (H + 2 * Hkv) * D && slot_mapping.numel() == N, "kvgen.paged_attention_qkv: qkv ", qkv.sizes(),
              " / slot_mapping do not fit the pools");
  const float* base = qkv.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(0 <= slots[i] && slots[i] < num_slots, "kvgen.paged_attention_qkv: slot ", slots[i], " outside the pool of ",
                num_slots);
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::Tensor held;
  const float* sk = sink_logits(sinks, H, held, "paged_attention_qkv");
  const auto [ks, vs] = row_scales(k_pool, k_scale, v_scale, "paged_attention_qkv");
  auto run = [&](auto* kp, auto* vp) {
    using T = std::remove_pointer_t<decltype(kp)>;
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t j = 0; j < Hkv; ++j) {  // slot s is row s % bs of block s / bs, in each head's part of the block
        const int64_t row = (slots[i] / bs * Hkv + j) * bs + slots[i] % bs;
        store_kv_row<T>(kp + row * D, ks ? ks + row : nullptr, base + i * W + (H + j) * D, D);
        store_kv_row<T>(vp + row * D, vs ? vs + row : nullptr, base + i * W + (H + Hkv + j) * D, D);
      }
    }
    return paged_impl<T>(base, W, D, N, H, k_pool, v_pool, {ks, vs}, block_tables, query_start_loc, seq_lens, sc,
                         window, cap, sk, qkv.options());
  };
  if (ks) return run(k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>());
  return k_pool.dtype() == at::kHalf ? run(k_pool.data_ptr<at::Half>(), v_pool.data_ptr<at::Half>())
                                     : run(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
}

}  // namespace kvgen
