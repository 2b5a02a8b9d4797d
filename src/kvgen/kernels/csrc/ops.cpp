// torch custom ops of kvgen's CPU kernels (namespace torch.ops.kvgen) and their checks.
// Each op has a plain-torch twin in kvgen/kernels/reference.py that is its spec.
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "aten_lite.h"
#include "team.h"
#include "common.h"
#include "ops.h"

namespace kvgen {

namespace {

int64_t record_bytes(int64_t weight_type) {
  TORCH_CHECK(weight_type >= kQ4 && weight_type <= kIQ1M && weight_type != kMixed, "kvgen: unknown weight_type ",
              weight_type);
  switch (weight_type) {
    case kQ4: return kQ4Record;
    case kQ8: return kQ8Record;
    case kQ6: return kQ6Record;
    case kQ5: return kQ5Record;
    case kQ50: return kQ50Record;
    case kIQ4: case kMXFP4: return kIQ4Record;
    case kQ40: return kQ40Record;
    case kQ2: return kQ2Record;
    case kQ3: return kQ3Record;
    case kQ4K: return kQ4KRecord;
    case kQ5K: return kQ5KRecord;
    case kIQ4XS: case kIQ3XXS: case kIQ3S: case kIQ2XXS: case kIQ1S: case kTQ: return kIQ4XSRecord;
    case kIQ2XS: case kIQ1M: return kXS16Record;
    default: return kF16Record;
  }
}

// 32-column blocks per record: 8 for the super-block records (Q2, Q3, Q4_K, Q5_K, Q6, IQ4_XS and the types recoded
// as IQ4_XS or XS16), else 1.
int64_t record_blocks(int64_t weight_type) {
  switch (weight_type) {
    case kQ2: case kQ3: case kQ4K: case kQ5K: case kQ6: return 8;
    default: return xs_table(weight_type) != nullptr || xs16_table(weight_type) != nullptr ? 8 : 1;
  }
}

// Types that read the activation blocks' half sums (their values carry an offset or a min per 16 columns): Q2, and
// Q3 and Q6 on AVX2 (on AVX512-VNNI their tiles read activation_half_offsets instead).
bool needs_half_sums(int64_t weight_type) {
  return ((weight_type == kQ6 || weight_type == kQ3) && !use_vnni()) || weight_type == kQ2;
}

void check_weight(const at::Tensor& weight, int64_t weight_type) {
  TORCH_CHECK(weight.dtype() == at::kByte && weight.dim() == 3 && weight.is_contiguous(),
              "kvgen: weight must be a contiguous uint8 [groups, records, record bytes] tensor");
  TORCH_CHECK(weight.size(2) == record_bytes(weight_type), "kvgen: weight record has ", weight.size(2),
              " bytes, expected ", record_bytes(weight_type));
}

// One run of row groups of a single weight type: groups [g0, g1) of the matrix, records from base. The types
// recoded as IQ4_XS records run as kIQ4XS with their table, the XS16 ones as kIQ2XS with theirs.
struct Segment {
  int64_t weight_type, g0, g1;
  const uint8_t* base;
  int64_t rec;  // bytes per 32 columns of a group (a record, or an eighth of a super-block record)
  const int8_t* table = nullptr;  // IQ4_XS and XS16 records: the values of their indices (xs_table, xs16_table)
};

// The segment of groups [g0, g1) of `weight_type` from base.
Segment segment(int64_t weight_type, int64_t g0, int64_t g1, const uint8_t* base) {
  const int8_t* xs = xs_table(weight_type);
  const int8_t* xs16 = xs16_table(weight_type);
  const int64_t type = xs != nullptr ? kIQ4XS : xs16 != nullptr ? kIQ2XS : weight_type;
  return {type, g0, g1, base, record_bytes(weight_type) / record_blocks(weight_type), xs != nullptr ? xs : xs16};
}

// The segments of a weight (one, or those of a kMixed weight's header; see common.h) and its groups, blocks.
std::vector<Segment> segments_of(const at::Tensor& weight, int64_t weight_type, int64_t& G, int64_t& nb) {
  if (weight_type != kMixed) {
    check_weight(weight, weight_type);
    const int64_t blocks = record_blocks(weight_type);
    G = weight.size(0), nb = weight.size(1) * blocks;
    return {segment(weight_type, 0, G, weight.data_ptr<uint8_t>())};
  }
  TORCH_CHECK(weight.dtype() == at::kByte && weight.dim() == 1 && weight.is_contiguous() && weight.numel() >= kMixedHeader,
              "kvgen: a mixed weight must be a contiguous uint8 [bytes] tensor with a ", kMixedHeader, "-byte header");
  int64_t head[kMixedHeader / 8];
  std::memcpy(head, weight.data_ptr<uint8_t>(), kMixedHeader);
  const int64_t num = head[0];
  nb = head[1];
  TORCH_CHECK(num >= 1 && num <= 3 && nb >= 1, "kvgen: mixed weight header holds ", num, " segments of ", nb, " blocks");
  std::vector<Segment> segs;
  const uint8_t* p = weight.data_ptr<uint8_t>() + kMixedHeader;
  G = 0;
  for (int64_t i = 0; i < num; ++i) {
    const int64_t type = head[2 + 2 * i], groups = head[3 + 2 * i];
    TORCH_CHECK(type >= kQ4 && type <= kIQ1M && type != kMixed && type != kF16 && type != kBF16,
                "kvgen: mixed weight segment of type ", type, " (quantized segments share the activations)");
    TORCH_CHECK(nb % record_blocks(type) == 0, "kvgen: mixed weight of ", nb, " blocks has a super-block segment");
    // a negative count would move the next segment's start before the data (the byte total can still match)
    TORCH_CHECK(groups >= 0 && groups <= std::numeric_limits<int64_t>::max() / record_bytes(type) / nb,
                "kvgen: mixed weight segment ", i, " has ", groups, " groups of ", nb, " blocks");
    segs.push_back(segment(type, G, G + groups, p));
    p += groups * nb * segs.back().rec;
    G += groups;
  }
  TORCH_CHECK(p == weight.data_ptr<uint8_t>() + weight.numel(), "kvgen: mixed weight has ", weight.numel(),
              " bytes, its header describes ", p - weight.data_ptr<uint8_t>());
  return segs;
}

// Rows of x [M, K] quantized into a [M, K / 32] array of BlockQ8A (stored in a uint8 tensor).
at::Tensor quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  at::Tensor q = at::empty({M, nb * static_cast<int64_t>(sizeof(BlockQ8A))}, x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  auto* qp = reinterpret_cast<BlockQ8A*>(q.data_ptr<uint8_t>());
  const int64_t grain = M * K < (1 << 16) ? M : std::max<int64_t>(1, (1 << 14) / K);
  parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row_q8a(xp + m * K, qp + m * nb, K);
  });
  return q;
}

at::Tensor quantize_q8a(const at::Tensor& x) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "kvgen.quantize_q8a: x must be float32 [M, K]");
  TORCH_CHECK(x.size(1) % kBlock == 0, "kvgen.quantize_q8a: K must be a multiple of 32, got ", x.size(1));
  return quantize_rows(x.contiguous());
}

}  // namespace

at::Tensor qgemm(const at::Tensor& x_in, const at::Tensor& weight, int64_t weight_type, int64_t out_features,
                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  int64_t G = 0, nb = 0;
  const std::vector<Segment> segs = segments_of(weight, weight_type, G, nb);
  TORCH_CHECK(x_in.dtype() == at::kFloat && x_in.dim() == 2, "kvgen.qgemm: x must be float32 [M, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K == nb * kBlock, "kvgen.qgemm: x has K=", K, " but the weight has ", nb * kBlock, " columns");
  TORCH_CHECK(out_features <= G * kRows && out_features > (G - 1) * kRows, "kvgen.qgemm: out_features ", out_features,
              " does not fit ", G, " row groups");
  const int64_t n_pad = G * kRows;
  at::Tensor out = at::empty({M, n_pad}, x.options());
  if (M == 0) return out.narrow(1, 0, out_features);
  // the quantized activations live in a per-thread buffer reused across calls (no allocation); F16
  // weights take the activations as they are
  const bool is_f16 = weight_type == kF16 || weight_type == kBF16;  // 16-bit float weights
  const bool has_half_sums = std::any_of(segs.begin(), segs.end(), [](const Segment& s) { return needs_half_sums(s.weight_type); });
  thread_local std::vector<BlockQ8A> act_buffer;
  if (!is_f16 && static_cast<int64_t>(act_buffer.size()) < M * nb) act_buffer.resize(M * nb);
  BlockQ8A* act = act_buffer.data();
  const float* xp = x.data_ptr<float>();
  // rows quantized per thread: in a thread team (team.h) a split costs ~0.1 us, so a decode step of more than 4 rows
  // shares them (16 rows: engine step 25.5 -> 24.9 ms; 4 rows split measured no better); otherwise an OpenMP fork
  // costs more than quantizing fewer than 2^16 values
  const int64_t qgrain = in_team() ? 4 : M * K < (1 << 16) ? M : std::max<int64_t>(1, (1 << 14) / K);
  thread_local std::vector<int32_t> sums_buffer;  // Q6, Q2, Q3: each activation block's half sums
  if (has_half_sums && static_cast<int64_t>(sums_buffer.size()) < M * nb) sums_buffer.resize(M * nb);
  int32_t* sums = sums_buffer.data();
  // the Q8, IQ4, MXFP4 and IQ4_XS VNNI tiles read 128 x each activation block's sum: made once a call
  const bool has_block_sums = use_vnni() && std::any_of(segs.begin(), segs.end(), [](const Segment& s) {
    return s.weight_type == kQ8 || s.weight_type == kIQ4 || s.weight_type == kMXFP4 || s.weight_type == kIQ4XS;
  });
  thread_local std::vector<int32_t> block_sums_buffer;
  if (has_block_sums && static_cast<int64_t>(block_sums_buffer.size()) < M * nb) block_sums_buffer.resize(M * nb);
  int32_t* block_sums = block_sums_buffer.data();
  // the Q6 (Q3) VNNI tile starts each 16-column half's sum at -32 (-4) x its activation sum: made once a call
  const auto has_type = [&segs](int64_t t) {
    return std::any_of(segs.begin(), segs.end(), [t](const Segment& s) { return s.weight_type == t; });
  };
  // (and the XS16 one at -128 x each half's sum)
  const bool has_q6_offsets = use_vnni() && has_type(kQ6), has_q3_offsets = use_vnni() && has_type(kQ3);
  const bool has_xs16_offsets = use_vnni() && has_type(kIQ2XS);
  thread_local std::vector<int32_t> q6_offsets_buffer, q3_offsets_buffer, xs16_offsets_buffer;
  for (auto [has, buffer] : {std::pair{has_q6_offsets, &q6_offsets_buffer}, {has_q3_offsets, &q3_offsets_buffer},
                             {has_xs16_offsets, &xs16_offsets_buffer}}) {
    if (has && static_cast<int64_t>(buffer->size()) < 2 * M * nb) buffer->resize(2 * M * nb);
  }
  int32_t* q6_offsets = q6_offsets_buffer.data();
  int32_t* q3_offsets = q3_offsets_buffer.data();
  int32_t* xs16_offsets = xs16_offsets_buffer.data();
  if (!is_f16) {
    parallel_for(0, M, qgrain, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        quantize_row_q8a(xp + m * K, act + m * nb, K);
        if (has_half_sums) activation_half_sums(act + m * nb, nb, sums + m * nb);
        if (has_block_sums) activation_block_sums(act + m * nb, nb, block_sums + m * nb);
        if (has_q6_offsets) activation_half_offsets(act + m * nb, nb, -32, q6_offsets + 2 * m * nb);
        if (has_q3_offsets) activation_half_offsets(act + m * nb, nb, -4, q3_offsets + 2 * m * nb);
        if (has_xs16_offsets) activation_half_offsets(act + m * nb, nb, -128, xs16_offsets + 2 * m * nb);
      }
    });
  }
  float* op = out.data_ptr<float>();
  // Split output rows (groups) across threads; every output element is computed by one
  // thread in one fixed order, so results do not depend on the thread count.
  // A thread's least work: 512 blocks of 32 columns (80 KB of Q4 records at M = 1). Decode reads the weights from
  // DRAM, where one thread streams half of what two do: at 2,048 blocks the default model's o_proj (72 groups of
  // 18 blocks) ran on one thread, 22.6 us a call cold vs 15.9 split (30 layers: ~0.2 ms of a 5.7 ms step).
  const int64_t grain = std::max<int64_t>(1, 512 / (nb * std::max<int64_t>(1, std::min<int64_t>(M, 4))));
  parallel_for(0, G, grain, [&](int64_t begin, int64_t end) {
    const BlockQ8A* a[kVnniRows];
    const int32_t* hs[kVnniRows];
    const int32_t* bs[kVnniRows];
    const int32_t* qo[kVnniRows];
    const int32_t* q3o[kVnniRows];
    const int32_t* xo[kVnniRows];
    const float* xr[kVnniRows];
    float* o[kVnniRows];
    thread_local std::vector<uint8_t> kscales_buffer;  // a group's unpacked 6-bit scales (and mins) (kept: no
                                                       // allocation per engine step)
    size_t si = 0;
    bool skip = false;  // the group after a pair: done
    for (int64_t g = begin; g < end; ++g) {
      if (skip) {
        skip = false;
        continue;
      }
      while (g >= segs[si].g1) ++si;  // groups ascend: the segment holding g
      const Segment& seg = segs[si];
      const uint8_t* wg = seg.base + (g - seg.g0) * nb * seg.rec;
      // activation rows a tile takes: kVnniRows on an AVX512-VNNI host (common.h), else 4
      const int64_t t = seg.weight_type;
      const int64_t rows = use_vnni() ? kVnniRows : 4;
      // With 8 activation rows or more on a VNNI host, groups go two at a time (the pair tiles, affine_pair_tile in
      // common.h: each activation broadcast serves 16 weight rows); a pair stays within one segment and one thread's
      // groups.
      const bool is_pair = use_vnni() && M >= kVnniRows && g + 1 < end && g + 1 < seg.g1;  // every type has one
      skip = is_pair;
      const uint8_t* wg1 = wg + nb * seg.rec;  // the next group (a pair's second)
      // a group of packed 6-bit scales met by several tiles has them unpacked once (k_quant_tile in common.h)
      const uint8_t* kscales = nullptr;
      if ((t == kQ4K || t == kQ5K || t == kIQ4XS) && M > rows) {
        const int64_t per_group = nb / 8 * 128;
        kscales_buffer.resize((is_pair ? 2 : 1) * per_group);
        for (int64_t h = 0; h < (is_pair ? 2 : 1); ++h) {
          for (int64_t sb = 0; sb < nb / 8; ++sb) {
            const uint8_t* record = (h ? wg1 : wg) + 8 * sb * seg.rec;
            uint8_t* dst = kscales_buffer.data() + h * per_group + (t == kIQ4XS ? 64 : 128) * sb;
            if (t == kIQ4XS) {
              iq4xs_scales(record + 16, reinterpret_cast<int8_t*>(dst));
            } else {
              k_scales_mins(record, dst);
            }
          }
        }
        kscales = kscales_buffer.data();
      }
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int mt = static_cast<int>(std::min<int64_t>(rows, M - m0));
        for (int i = 0; i < mt; ++i) {
          a[i] = act + (m0 + i) * nb;
          hs[i] = sums + (m0 + i) * nb;
          bs[i] = block_sums + (m0 + i) * nb;
          qo[i] = q6_offsets + 2 * (m0 + i) * nb;
          q3o[i] = q3_offsets + 2 * (m0 + i) * nb;
          xo[i] = xs16_offsets + 2 * (m0 + i) * nb;
          xr[i] = xp + (m0 + i) * K;
          o[i] = op + (m0 + i) * n_pad + g * kRows;
        }
        const uint8_t* kscales1 = is_pair && kscales != nullptr ? kscales + nb / 8 * 128 : nullptr;  // the 2nd group's
        if (is_pair && mt == kVnniRows) {
          switch (t) {
            case kQ4: case kQ40: q4_pair_tile(wg, wg1, a, nb, o, t == kQ4); break;
            case kQ5: case kQ50: q5_pair_tile(wg, wg1, a, nb, o, t == kQ5); break;
            case kQ4K: q4k_pair_tile(wg, wg1, a, nb, o, kscales, kscales1); break;
            case kQ5K: q5k_pair_tile(wg, wg1, a, nb, o, kscales, kscales1); break;
            case kQ6: q6_pair_tile(wg, wg1, a, qo, nb, o); break;
            case kIQ4: iq4_pair_tile(wg, wg1, a, bs, nb, o, kIQ4Values); break;
            case kMXFP4: iq4_pair_tile(wg, wg1, a, bs, nb, o, kMXFP4Values); break;
            case kIQ4XS:
              iq4xs_pair_tile(wg, wg1, a, bs, nb, o, reinterpret_cast<const int8_t*>(kscales),
                              reinterpret_cast<const int8_t*>(kscales1), seg.table);
              break;
            case kF16: case kBF16: f16_pair_tile(wg, wg1, xr, nb, o, t == kBF16); break;
            case kQ2: q2_pair_tile(wg, wg1, a, hs, nb, o); break;
            case kQ3: q3_pair_tile(wg, wg1, a, q3o, nb, o); break;
            case kIQ2XS: xs16_pair_tile(wg, wg1, a, xo, nb, o, seg.table); break;
            default: q8_pair_tile(wg, wg1, a, bs, nb, o); break;
          }
          continue;
        }
        for (int h = 0; h < (is_pair ? 2 : 1); ++h) {  // one group, or each of a pair's for fewer rows
          const uint8_t* w = h ? wg1 : wg;
          const uint8_t* ks = h ? kscales1 : kscales;
          if (h)
            for (int i = 0; i < mt; ++i) o[i] += kRows;
          switch (seg.weight_type) {
            case kF16: f16_group(w, xr, mt, nb, o); break;
            case kBF16: bf16_group(w, xr, mt, nb, o); break;
            case kQ6: q6_group(w, a, hs, has_q6_offsets ? qo : nullptr, mt, nb, o); break;
            case kQ4: q4_group(w, a, mt, nb, o); break;
            case kQ40: q40_group(w, a, mt, nb, o); break;
            case kQ4K: q4k_group(w, a, mt, nb, o, ks); break;
            case kQ5K: q5k_group(w, a, mt, nb, o, ks); break;
            case kIQ4XS:
              iq4xs_group(w, a, has_block_sums ? bs : nullptr, mt, nb, o, reinterpret_cast<const int8_t*>(ks),
                          seg.table);
              break;
            case kQ5: q5_group(w, a, mt, nb, o); break;
            case kQ50: q50_group(w, a, mt, nb, o); break;
            case kIQ4: iq4_group(w, a, has_block_sums ? bs : nullptr, mt, nb, o, kIQ4Values); break;
            case kMXFP4: iq4_group(w, a, has_block_sums ? bs : nullptr, mt, nb, o, kMXFP4Values); break;
            case kQ2: q2_group(w, a, hs, mt, nb, o); break;
            case kQ3: q3_group(w, a, hs, has_q3_offsets ? q3o : nullptr, mt, nb, o); break;
            case kIQ2XS: xs16_group(w, a, has_xs16_offsets ? xo : nullptr, mt, nb, o, seg.table); break;
            default: q8_group(w, a, has_block_sums ? bs : nullptr, mt, nb, o); break;
          }
        }
      }
    }
  });
  at::Tensor result = n_pad == out_features ? out : out.narrow(1, 0, out_features).contiguous();
  if (bias.has_value() && bias->defined()) result.add_(*bias);
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->numel() == result.numel(), "kvgen.qgemm: residual must be [M, N]");
    result.add_(residual->view({M, out_features}));
  }
  return result;
}

namespace {

// Row r's 32 values of block k (0-7) of a Q2 / Q3 super-block record, as ggml dequantize_row_q2_K / _q3_K.
void q23_block_values(const uint8_t* rec, int64_t k, int64_t r, bool q3, float* dst) {
  uint16_t h;
  std::memcpy(&h, rec + 2 * r, 2);
  const float d = _cvtsh_ss(h);
  std::memcpy(&h, rec + 16 + 2 * r, 2);
  const float dmin = _cvtsh_ss(h);
  for (int half = 0; half < 2; ++half) {
    const uint8_t scale = rec[(q3 ? 16 : 32) + 16 * k + 8 * half + r];
    const float dl = q3 ? d * static_cast<float>(static_cast<int8_t>(scale)) : d * static_cast<float>(scale & 15);
    const float ml = q3 ? 0.0f : dmin * static_cast<float>(scale >> 4);
    for (int s = 0; s < 4; ++s) {
      for (int i = 0; i < 4; ++i) {
        int u = (rec[(q3 ? 144 : 160) + 64 * k + 32 * half + 4 * r + i] >> (2 * s)) & 3;
        if (q3) u = (u | (((rec[656 + 32 * k + 4 * r + i] >> (4 * half + s)) & 1) << 2)) - 4;
        dst[16 * half + 4 * s + i] = dl * static_cast<float>(u) - ml;
      }
    }
  }
}

// Row r's 32 values of block k (0-7) of a Q4_K (Q5_K) super-block record: (d sc) u - (dmin m), as ggml
// dequantize_row_q4_K (_q5_K).
void k_block_values(const uint8_t* rec, int64_t k, int64_t r, bool five, float* dst) {
  uint16_t h;
  std::memcpy(&h, rec + 2 * r, 2);
  const uint8_t low = rec[32 + 8 * k + r], top = rec[96 + 8 * (k % 4) + r] >> (2 * (k / 4));  // layout: common.h
  const float d = _cvtsh_ss(h) * static_cast<float>((low & 15) | (top & 3) << 4);
  std::memcpy(&h, rec + 16 + 2 * r, 2);
  const float m = _cvtsh_ss(h) * static_cast<float>((low >> 4) | ((top >> 4) & 3) << 4);
  const uint8_t* blk = rec + 128 + (five ? 160 : 128) * k;  // nibbles, then (Q5_K) the high bits at 128
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = blk[32 * t + 4 * r + i], hb = five ? blk[128 + 4 * r + i] : 0;
      dst[4 * t + i] = d * static_cast<float>((byte & 15) | (((hb >> t) & 1) << 4)) - m;
      dst[16 + 4 * t + i] = d * static_cast<float>((byte >> 4) | (((hb >> (4 + t)) & 1) << 4)) - m;
    }
  }
}

// Row r's 32 values of block k (0-7) of an IQ4_XS super-block record: (d (ls - 32)) table[nibble] (kIQ4Values: as
// ggml dequantize_row_iq4_xs).
void iq4xs_block_values(const uint8_t* rec, int64_t k, int64_t r, const int8_t* table, float* dst) {
  uint16_t h;
  std::memcpy(&h, rec + 2 * r, 2);
  const int ls = ((rec[16 + 8 * (k % 4) + r] >> (4 * (k / 4))) & 15) |
                 ((rec[48 + 8 * (k % 2) + r] >> (2 * (k / 2))) & 3) << 4;
  const float dl = _cvtsh_ss(h) * static_cast<float>(ls - 32);  // layout: common.h
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = rec[64 + 128 * k + 32 * t + 4 * r + i];
      dst[4 * t + i] = dl * static_cast<float>(table[byte & 15]);
      dst[16 + 4 * t + i] = dl * static_cast<float>(table[byte >> 4]);
    }
  }
}

// Row r's 32 values of block k (0-7) of an XS16 super-block record: d sc[k][h] table[nibble] (common.h).
void xs16_block_values(const uint8_t* rec, int64_t k, int64_t r, const int8_t* table, float* dst) {
  uint16_t h;
  std::memcpy(&h, rec + 2 * r, 2);
  const float d = _cvtsh_ss(h);
  const auto* sc = reinterpret_cast<const int8_t*>(rec + 16 + 16 * k);
  const float d0 = d * static_cast<float>(sc[r]), d1 = d * static_cast<float>(sc[8 + r]);
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = rec[144 + 128 * k + 32 * t + 4 * r + i];
      dst[4 * t + i] = d0 * static_cast<float>(table[byte & 15]);
      dst[16 + 4 * t + i] = d1 * static_cast<float>(table[byte >> 4]);
    }
  }
}

// Row r's 32 values of block k (0-7) of a Q6 super-block record: d sc (u - 32), as ggml dequantize_row_q6_K.
void q6_block_values(const uint8_t* rec, int64_t k, int64_t r, float* dst) {
  uint16_t h;
  std::memcpy(&h, rec + 2 * r, 2);
  const float d = _cvtsh_ss(h);
  const uint8_t* blk = rec + kQ6Block * k;
  const auto* sc = reinterpret_cast<const int8_t*>(blk + 16);
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 4; ++i) {
      const uint8_t lo = blk[32 + 32 * t + 4 * r + i], hi = blk[160 + 32 * (t / 2) + 4 * r + i];
      const int shift = 4 * (t & 1);  // hi holds t = 2v at bits 0-3, t = 2v + 1 at bits 4-7
      const int u0 = (lo & 15) | (((hi >> shift) & 3) << 4), u1 = (lo >> 4) | (((hi >> (shift + 2)) & 3) << 4);
      dst[4 * t + i] = d * static_cast<float>(sc[r]) * static_cast<float>(u0 - 32);
      dst[16 + 4 * t + i] = d * static_cast<float>(sc[8 + r]) * static_cast<float>(u1 - 32);
    }
  }
}

// Rows `ids` of a repacked weight, dequantized: [n, in_features] float32 (embedding lookup).
at::Tensor dequantize_rows(const at::Tensor& weight, int64_t weight_type, const at::Tensor& ids_in, int64_t in_features) {
  check_weight(weight, weight_type);
  const int64_t blocks = record_blocks(weight_type), nb = weight.size(1) * blocks, rec = record_bytes(weight_type);
  TORCH_CHECK(in_features == nb * kBlock, "kvgen.dequantize_rows: in_features ", in_features, " != ", nb * kBlock);
  // float ids were truncated by the cast (1.7 read row 1); the reference's index_select refuses them
  TORCH_CHECK(c10::isIntegralType(ids_in.scalar_type(), /*includeBool=*/false),
              "kvgen.dequantize_rows: ids must be an integer tensor, got ", ids_in.scalar_type());
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), num_rows = weight.size(0) * kRows;
  at::Tensor out = at::empty({n, in_features}, weight.options().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(ip[k] >= 0 && ip[k] < num_rows, "kvgen.dequantize_rows: id ", ip[k], " out of range [0, ", num_rows, ")");
  }
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t g = ip[k] / kRows, r = ip[k] % kRows;
      float* dst = op + k * in_features;
      for (int64_t b = 0; b < nb; ++b, dst += kBlock) {
        if (blocks == 8) {  // block b % 8 of a super-block record
          const uint8_t* sb = wp + (g * (nb / 8) + b / 8) * rec;
          switch (weight_type) {
            case kQ4K: case kQ5K: k_block_values(sb, b % 8, r, weight_type == kQ5K, dst); break;
            case kQ6: q6_block_values(sb, b % 8, r, dst); break;
            case kQ2: case kQ3: q23_block_values(sb, b % 8, r, weight_type == kQ3, dst); break;
            case kIQ2XS: case kIQ1M: xs16_block_values(sb, b % 8, r, xs16_table(weight_type), dst); break;
            default: iq4xs_block_values(sb, b % 8, r, xs_table(weight_type), dst); break;  // IQ4_XS records
          }
          continue;
        }
        const uint8_t* blk = wp + (g * nb + b) * rec;
        uint16_t h;
        std::memcpy(&h, blk + 2 * r, 2);
        const float d = _cvtsh_ss(h);
        if (weight_type == kF16 || weight_type == kBF16) {
          for (int c = 0; c < kBlock; ++c) {
            std::memcpy(&h, blk + 16 * c + 2 * r, 2);
            if (weight_type == kF16) {
              dst[c] = _cvtsh_ss(h);
            } else {
              const uint32_t bits = static_cast<uint32_t>(h) << 16;
              std::memcpy(dst + c, &bits, 4);
            }
          }
          continue;
        }
        if (weight_type == kIQ4 || weight_type == kMXFP4) {
          const int8_t* values = weight_type == kIQ4 ? kIQ4Values : kMXFP4Values;
          for (int t = 0; t < 4; ++t) {
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = blk[16 + 32 * t + 4 * r + i];
              dst[4 * t + i] = d * static_cast<float>(values[byte & 15]);
              dst[16 + 4 * t + i] = d * static_cast<float>(values[byte >> 4]);
            }
          }
        } else if (weight_type == kQ4 || weight_type == kQ5 || weight_type == kQ40 || weight_type == kQ50) {
          std::memcpy(&h, blk + 16 + 2 * r, 2);
          // Q4_0, Q5_0: no m stored, m = -8 d, -16 d
          const float mn = weight_type == kQ40 ? -8.0f * d : weight_type == kQ50 ? -16.0f * d : _cvtsh_ss(h);
          const bool has_min = weight_type == kQ4 || weight_type == kQ5;
          const int64_t qs = has_min ? 32 : 16, qh = has_min ? 160 : 144;
          for (int t = 0; t < 4; ++t) {
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = blk[qs + 32 * t + 4 * r + i];
              // Q5, Q5_0: the high bits
              const uint8_t hb = weight_type == kQ5 || weight_type == kQ50 ? blk[qh + 4 * r + i] : 0;
              const int lo = (byte & 15) | (((hb >> t) & 1) << 4), hi = (byte >> 4) | (((hb >> (4 + t)) & 1) << 4);
              dst[4 * t + i] = static_cast<float>(lo) * d + mn;
              dst[16 + 4 * t + i] = static_cast<float>(hi) * d + mn;
            }
          }
        } else {
          const uint8_t* qs = blk + 16;  // Q8: the values plus 128
          for (int j = 0; j < 8; ++j) {
            for (int i = 0; i < 4; ++i) {
              dst[4 * j + i] = static_cast<float>(static_cast<int>(qs[32 * j + 4 * r + i]) - 128) * d;
            }
          }
        }
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace kvgen

namespace kvgen {

bool use_vnni() {
  static const bool enabled = [] {
    const char* isa = std::getenv("KVGEN_KERNELS_ISA");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           !(isa != nullptr && std::string(isa) == "avx2");
  }();
  return enabled;
}

// The instruction set of qgemm's quantized tiles here: 1 AVX512-VNNI, 0 AVX2 (use_vnni, common.h).
int64_t kernel_isa() { return use_vnni() ? 1 : 0; }

}  // namespace kvgen

TORCH_LIBRARY(kvgen, m) {
  m.def("kernel_isa() -> int", &kvgen::kernel_isa);
  m.def("quantize_q8a(Tensor x) -> Tensor");
  m.def("qgemm(Tensor x, Tensor weight, int weight_type, int out_features, Tensor? bias, Tensor? residual=None) -> Tensor");
  m.def("dequantize_rows(Tensor weight, int weight_type, Tensor ids, int in_features) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? key_mask, int past_len, float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_heads_(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, float eps, int num_heads, int num_kv_heads) -> ()");
  m.def("rope_qkv_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.def("gpt_oss_glu(Tensor gate_up) -> Tensor");
  m.def("repack_gguf(Tensor[] parts, int gguf_type, Tensor(a!)? out=None) -> Tensor");
  m.def("recode_gguf(Tensor raw, int ggml_type, Tensor grid) -> Tensor");
  m.def("static_attention(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? key_mask, int past_len, "
        "int num_heads, float scale, int window=0, float softcap=0.0, Tensor? sinks=None, Tensor(c!)? k_scale=None, "
        "Tensor(d!)? v_scale=None) -> Tensor");
  m.def("paged_attention_qkv(Tensor qkv, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slot_mapping, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, int num_heads, float scale, int window=0, float softcap=0.0, "
        "Tensor? sinks=None, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor");
  m.def("decoder_layers(Tensor x, Tensor[] weights, int[] linears, float[] eps, Tensor?[] extras, int[] layer_args, "
        "Tensor[] rope, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor? key_mask, int past_len, int num_heads, "
        "int num_kv_heads, float scale, int activation, float softcap, Tensor(c!)[] k_scales, Tensor(d!)[] v_scales) "
        "-> Tensor");
  m.def("paged_decoder_layers(Tensor x, Tensor[] weights, int[] linears, float[] eps, Tensor?[] extras, int[] layer_args, "
        "Tensor[] rope, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, Tensor slot_mapping, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, int num_heads, int num_kv_heads, float scale, int activation, "
        "float softcap, Tensor(c!)[] k_scales, Tensor(d!)[] v_scales) -> Tensor");
  m.def("softmax_draw(Tensor logits, Tensor temperature, Tensor u) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("filter_draw(Tensor logits, Tensor temperature, Tensor min_p, Tensor top_k, Tensor top_p, Tensor u) -> Tensor");
  m.def("linear_f64(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("moe_experts_row(Tensor h, Tensor[] gate_up, int[] gate_up_linears, Tensor[] down, int[] down_linears, "
        "float[] expert_weights, Tensor?[] biases, int activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgen, CPU, m) {
  m.impl("quantize_q8a", &kvgen::quantize_q8a);
  m.impl("qgemm", &kvgen::qgemm);
  m.impl("dequantize_rows", &kvgen::dequantize_rows);
  m.impl("attention", &kvgen::attention);
  m.impl("paged_attention", &kvgen::paged_attention);
  m.impl("rms_norm", &kvgen::rms_norm);
  m.impl("rms_norm_heads_", &kvgen::rms_norm_heads_);
  m.impl("rope_qkv_", &kvgen::rope_qkv_);
  m.impl("silu_mul", &kvgen::silu_mul);
  m.impl("gelu_tanh_mul", &kvgen::gelu_tanh_mul);
  m.impl("gpt_oss_glu", &kvgen::gpt_oss_glu);
  m.impl("repack_gguf", &kvgen::repack_gguf);
  m.impl("recode_gguf", &kvgen::recode_gguf);
  m.impl("static_attention", &kvgen::static_attention);
  m.impl("paged_attention_qkv", &kvgen::paged_attention_qkv);
  m.impl("decoder_layers", &kvgen::decoder_layers);
  m.impl("paged_decoder_layers", &kvgen::paged_decoder_layers);
  m.impl("softmax_draw", &kvgen::softmax_draw);
  m.impl("argmax", &kvgen::argmax);
  m.impl("filter_draw", &kvgen::filter_draw);
  m.impl("linear_f64", &kvgen::linear_f64);
  m.impl("moe_experts_row", &kvgen::moe_experts_row);
}
