#pragma once
/// The arithmetic of the CUDA kernels, as small __host__ __device__ functions: the kernels in
/// engine/cuda/*.cu call them, and host unit tests (tests/unit/engine_cuda) call the very same
/// functions compiled by the host compiler and check them against the CPU engine. A kernel's
/// __global__ function then only maps threads to data (docs/gpu.md).
///
/// What lives here: float8 e4m3 decode with 128x128 block scales, e4m3 encode and the FP8 KV
/// cache's token format (pd/common/kv_format.h), and BF16 conversion; the YaRN
/// inverse frequencies and the interleaved RoPE rotation; noaux_tc grouped top-k routing with the
/// CPU engine's tie order; the merge of split-KV softmax partials; the sampling transforms
/// (penalties, temperature weights, top-k / top-p / min-p cut-offs, the draw) and the
/// counter-based generator; the FP8 GEMV's per-lane accumulation and its butterfly reduction, and
/// the grouped GEMV's for FP32, BF16 and FP8 experts; the MoE grouping of tokens by expert and the
/// weighted combine in ascending expert order.
///
/// Compiles as C++17 under nvcc and as C++20 under the host compiler; no allocation, no library
/// calls but the math functions. Thread rules: pure functions.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PD_HD __host__ __device__ inline
#else
#define PD_HD inline
#endif

namespace pd::gpu::math {

// ---------------------------------------------------------------------------------------------
// Math functions: the device's single-precision intrinsics on the GPU, <cmath> on the host (the
// CPU engine calls the same <cmath> functions, so host results are bit-identical to it).

PD_HD float expF(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
PD_HD double expD(double x) {
#if defined(__CUDA_ARCH__)
  return exp(x);
#else
  return std::exp(x);
#endif
}
PD_HD float sqrtF(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);
#else
  return std::sqrt(x);
#endif
}
PD_HD float fmaF(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
PD_HD float cosF(float x) {
#if defined(__CUDA_ARCH__)
  return cosf(x);
#else
  return std::cos(x);
#endif
}
PD_HD float sinF(float x) {
#if defined(__CUDA_ARCH__)
  return sinf(x);
#else
  return std::sin(x);
#endif
}
PD_HD float powF(float x, float y) {
#if defined(__CUDA_ARCH__)
  return powf(x, y);
#else
  return std::pow(x, y);
#endif
}
PD_HD double logD(double x) {
#if defined(__CUDA_ARCH__)
  return log(x);
#else
  return std::log(x);
#endif
}

PD_HD float bitsToFloat(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}
PD_HD std::uint32_t floatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

PD_HD float negInfF() {
  return bitsToFloat(0xFF800000U);
}

// ---------------------------------------------------------------------------------------------
// Value decode.

/// float8 e4m3fn -> float32, exact: the same bit construction as pd::fp8e4m3ToFloat (0x7F and
/// 0xFF are NaN, no infinities, subnormals m * 2^-9).
PD_HD float fp8e4m3Decode(std::uint8_t code) {
  const std::uint32_t sign = (static_cast<std::uint32_t>(code) & 0x80U) << 24;
  const std::uint32_t exponent = (static_cast<std::uint32_t>(code) >> 3) & 0xFU;
  const std::uint32_t mantissa = static_cast<std::uint32_t>(code) & 0x7U;
  if (exponent == 0xFU && mantissa == 0x7U) return bitsToFloat(sign | 0x7FC00000U);
  if (exponent != 0) return bitsToFloat(sign | ((exponent + 127U - 7U) << 23) | (mantissa << 20));
  // Zero or subnormal: m * 2^-9 is exact in float32.
  return bitsToFloat(sign | floatToBits(static_cast<float>(mantissa) * 0x1p-9F));
}

/// Where an FP8 weight's scale sits in a [ceil(rows / block_rows), scale_cols] scale matrix.
PD_HD std::int64_t fp8ScaleIndex(std::int64_t row, std::int64_t col, std::int64_t scale_cols, std::int64_t block_rows,
                                 std::int64_t block_cols) {
  return (row / block_rows) * scale_cols + col / block_cols;
}

/// W[row][col] of a block-scaled FP8 matrix as float32: e4m3(q) * scale_inv, one rounding, as the
/// CPU engine's dequantizeRow computes it.
PD_HD float fp8BlockScaledValue(std::uint8_t q, float scale_inv) {
  return fp8e4m3Decode(q) * scale_inv;
}

/// bfloat16 -> float32 (exact).
PD_HD float bf16Decode(std::uint16_t bits) {
  return bitsToFloat(static_cast<std::uint32_t>(bits) << 16);
}

/// float32 -> bfloat16, round to nearest even, NaN kept NaN: pd::floatToBf16's rule.
PD_HD std::uint16_t bf16Encode(float value) {
  const std::uint32_t bits = floatToBits(value);
  if ((bits & 0x7F800000U) == 0x7F800000U && (bits & 0x007FFFFFU) != 0) {
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040U);
  }
  const std::uint32_t lsb = (bits >> 16) & 1U;
  return static_cast<std::uint16_t>((bits + 0x7FFFU + lsb) >> 16);
}

/// `value` as a BF16 cache holds it: bf16Decode(bf16Encode(value)) (round to nearest even).
PD_HD float bf16Round(float value) {
  return bf16Decode(bf16Encode(value));
}

/// float32 -> e4m3fn, round to nearest even, saturating to +-448, NaN -> 0x7F: pd::floatToFp8e4m3's
/// construction (the sign survives rounding to zero).
PD_HD std::uint8_t fp8e4m3Encode(float value) {
  const std::uint32_t bits = floatToBits(value);
  const std::uint32_t abs_bits = bits & 0x7FFFFFFFU;
  if (abs_bits > 0x7F800000U) return 0x7F;  // NaN
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80U);
  const float magnitude = bitsToFloat(abs_bits);
  if (magnitude >= 448.0F) return static_cast<std::uint8_t>(sign | 0x7EU);
  if (magnitude < 0x1p-6F) {
    // Subnormal: the nearest multiple of 2^-9 (scaling by 512 and splitting off the fraction are exact).
    const float scaled = magnitude * 512.0F;
    auto whole = static_cast<std::uint32_t>(scaled);
    const float fraction = scaled - static_cast<float>(whole);
    if (fraction > 0.5F || (fraction == 0.5F && (whole & 1U) != 0)) ++whole;
    return static_cast<std::uint8_t>(sign | whole);
  }
  const std::uint32_t lsb = (abs_bits >> 20) & 1U;
  const std::uint32_t rounded = (abs_bits + 0x7FFFFU + lsb) >> 20;
  const std::uint32_t code = rounded - ((127U - 7U) << 3);
  return static_cast<std::uint8_t>(sign | (code > 0x7EU ? 0x7EU : code));
}

/// |x| (the sign bit cleared: exact).
PD_HD float absF(float x) {
  return bitsToFloat(floatToBits(x) & 0x7FFFFFFFU);
}
/// a / b and a * b rounded to nearest, never fused or approximated by the device compiler.
PD_HD float divRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
PD_HD float mulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// An FP8 KV cache token (pd/common/kv_format.h): tiles of kKvFp8Tile values, each with
// scale = max|x| / 448 and codes e4m3(x / scale); a value reads back as e4m3(code) * scale.
inline constexpr int kKvFp8Tile = 64;
PD_HD float kvFp8Scale(float tile_amax) {
  return divRn(tile_amax, 448.0F);
}
PD_HD std::uint8_t kvFp8Code(float x, float scale) {
  return scale > 0.0F ? fp8e4m3Encode(divRn(x, scale)) : std::uint8_t{0};
}
PD_HD float kvFp8Value(std::uint8_t code, float scale) {
  return mulRn(fp8e4m3Decode(code), scale);
}
/// The FP8 token layout: codes [d] padded to a multiple of 4, then one float32 scale per tile.
PD_HD int kvFp8ScaleOffset(int d) {
  return (d + 3) / 4 * 4;
}
PD_HD int kvFp8TokenBytes(int d) {
  return kvFp8ScaleOffset(d) + (d + kKvFp8Tile - 1) / kKvFp8Tile * 4;
}
/// A float32 at a 4-byte aligned address inside a token.
PD_HD void storeF32(std::uint8_t* at, float value) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<float*>(at) = value;
#else
  std::memcpy(at, &value, sizeof value);
#endif
}
PD_HD float loadF32(const std::uint8_t* at) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const float*>(at);
#else
  float value;
  std::memcpy(&value, at, sizeof value);
  return value;
#endif
}
/// Encodes tile `tile` of a d-value latent `x` into `token` (its codes and its scale).
PD_HD void kvFp8EncodeTile(const float* x, int d, int tile, std::uint8_t* token) {
  const int first = tile * kKvFp8Tile;
  const int last = first + kKvFp8Tile < d ? first + kKvFp8Tile : d;
  float amax = 0.0F;
  for (int i = first; i < last; ++i) {
    const float a = absF(x[i]);
    if (a > amax) amax = a;
  }
  const float scale = kvFp8Scale(amax);
  for (int i = first; i < last; ++i) token[i] = kvFp8Code(x[i], scale);
  storeF32(token + kvFp8ScaleOffset(d) + static_cast<std::int64_t>(tile) * 4, scale);
}
/// The padding bytes between the codes and the scales (zero).
PD_HD void kvFp8ZeroPadding(int d, std::uint8_t* token) {
  for (int i = d; i < kvFp8ScaleOffset(d); ++i) token[i] = 0;
}
/// One token, as pd::encodeKvToken(F8E4M3) writes it.
PD_HD void kvFp8EncodeToken(const float* x, int d, std::uint8_t* token) {
  for (int t = 0; t * kKvFp8Tile < d; ++t) kvFp8EncodeTile(x, d, t, token);
  kvFp8ZeroPadding(d, token);
}
/// Value `i` of an FP8 token.
PD_HD float kvFp8At(const std::uint8_t* token, int d, int i) {
  return kvFp8Value(token[i], loadF32(token + kvFp8ScaleOffset(d) + static_cast<std::int64_t>(i / kKvFp8Tile) * 4));
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: the CPU engine sums squares in double, takes the mean in float, then
// out = (x * inv) * w.

/// 1 / sqrt(mean(x^2) + eps) from the sum of squares of n values.
PD_HD float rmsInverse(double sum_squares, std::int64_t n, float eps) {
  const float mean = static_cast<float>(sum_squares / static_cast<double>(n));
  return 1.0F / sqrtF(mean + eps);
}
PD_HD float rmsNormValue(float x, float inv, float weight) {
  return (x * inv) * weight;
}

// ---------------------------------------------------------------------------------------------
// RoPE (DeepSeek's interleaved pairs, YaRN frequencies).

/// f_j = 1 / theta^(2j / dim) in float32 (pair j of a rotary dimension dim).
PD_HD float ropeBaseFrequency(std::int64_t j, std::int64_t dim, float theta) {
  return 1.0F / powF(theta, static_cast<float>(2 * j) / static_cast<float>(dim));
}

/// YaRN's correction range [low, high] over pair indices, in double as the reference computes it
/// with Python floats (model/rope.cpp).
PD_HD void yarnCorrectionRange(std::int64_t dim, double theta, std::int64_t original_max_positions, double beta_fast,
                               double beta_slow, double& low, double& high) {
  const double pi = 3.14159265358979323846;
  const double d = static_cast<double>(dim);
  const double orig = static_cast<double>(original_max_positions);
  const double lo = d * logD(orig / (beta_fast * 2.0 * pi)) / (2.0 * logD(theta));
  const double hi = d * logD(orig / (beta_slow * 2.0 * pi)) / (2.0 * logD(theta));
  low = ::floor(lo);
  low = low > 0.0 ? low : 0.0;
  high = ::ceil(hi);
  high = high < d - 1.0 ? high : d - 1.0;
  if (low == high) high += 0.001;
}

/// The YaRN correction of base frequency `freq` of pair j, given the correction range [low, high]
/// (computed in double on the host, model/rope.cpp) and the scaling factor.
PD_HD float yarnFrequency(float freq, std::int64_t j, double low, double high, float factor) {
  float ramp = (static_cast<float>(j) - static_cast<float>(low)) / static_cast<float>(high - low);
  ramp = ramp < 0.0F ? 0.0F : (ramp > 1.0F ? 1.0F : ramp);
  const float smooth = 1.0F - ramp;
  return freq / factor * (1.0F - smooth) + freq * smooth;
}

/// The rotation angle of pair j at position pos: float32(pos) * inv_freq[j].
PD_HD float ropeAngle(std::int64_t pos, float inv_freq) {
  return static_cast<float>(pos) * inv_freq;
}

/// Rotates one interleaved pair (a, b) by the angle whose cosine and sine are c and s.
PD_HD void ropeRotatePair(float& a, float& b, float c, float s) {
  const float x = a;
  const float y = b;
  a = x * c - y * s;
  b = x * s + y * c;
}

// ---------------------------------------------------------------------------------------------
// MoE routing: noaux_tc (sigmoid scores, e_score_correction_bias for selection only, group-limited
// top-k, weights renormalized over the chosen experts and scaled).

PD_HD float sigmoidF(float x) {
  return 1.0F / (1.0F + expF(-x));
}

/// The SwiGLU activation as the CPU engine computes it: silu(g) * u, silu(g) = g / (1 + e^-g).
PD_HD float siluMul(float g, float u) {
  return g / (1.0F + expF(-g)) * u;
}

/// Sizes the routing scratch must hold; the host validates the model against them.
constexpr std::int64_t kMaxRoutedExperts = 512;
constexpr std::int64_t kMaxExpertGroups = 64;

struct RoutingShape {
  std::int64_t experts = 0;     ///< n_routed_experts (<= kMaxRoutedExperts)
  std::int64_t groups = 1;      ///< n_group (divides experts, <= kMaxExpertGroups)
  std::int64_t topk_group = 1;  ///< groups kept
  std::int64_t top_k = 1;       ///< experts per token
  float routed_scaling = 1.0F;
};

/// Whether a candidate (value va, index a) ranks before (vb, b): larger value first, lower index
/// on ties (the CPU engine's partial_sort comparator; its stable_sort of groups gives the same).
PD_HD bool ranksBefore(float va, std::int64_t a, float vb, std::int64_t b) {
  return va > vb || (va == vb && a < b);
}

/// Routes one token. `logits` [experts]; `bias` [experts] or null; scratch `score`, `biased`
/// [experts] and `group_score` [groups]; out_idx/out_weight [top_k] in descending biased score.
/// The same selections, tie order and float operations as the CPU engine's moe().
PD_HD void routeNoauxTc(const float* logits, const float* bias, const RoutingShape& shape, float* score, float* biased,
                        float* group_score, std::int32_t* out_idx, float* out_weight) {
  const std::int64_t n = shape.experts;
  const std::int64_t per_group = n / shape.groups;
  for (std::int64_t e = 0; e < n; ++e) {
    score[e] = sigmoidF(logits[e]);
    biased[e] = bias == nullptr ? score[e] : score[e] + bias[e];
  }
  if (shape.groups > 1) {
    for (std::int64_t g = 0; g < shape.groups; ++g) {
      const float* gb = biased + g * per_group;
      float a = negInfF();
      float b = negInfF();  // the two largest
      for (std::int64_t i = 0; i < per_group; ++i) {
        if (gb[i] > a) {
          b = a;
          a = gb[i];
        } else if (gb[i] > b) {
          b = gb[i];
        }
      }
      // Without a bias the reference scores a group by its maximum, with one by its top two.
      group_score[g] = (bias == nullptr || per_group == 1) ? a : a + b;
    }
    // Keep the topk_group best groups (ties: lower group first); mask the rest with -inf.
    std::uint64_t kept = 0;  // bit g: group g kept
    for (std::int64_t k = 0; k < shape.topk_group; ++k) {
      std::int64_t best = -1;
      for (std::int64_t g = 0; g < shape.groups; ++g) {
        if (((kept >> g) & 1U) != 0) continue;
        if (best < 0 || ranksBefore(group_score[g], g, group_score[best], best)) best = g;
      }
      kept |= std::uint64_t{1} << best;
    }
    for (std::int64_t g = 0; g < shape.groups; ++g) {
      if (((kept >> g) & 1U) == 0) {
        for (std::int64_t i = 0; i < per_group; ++i) biased[g * per_group + i] = negInfF();
      }
    }
  }
  // Top-k by repeated best-of-the-rest (larger first, lower id on ties).
  for (std::int64_t k = 0; k < shape.top_k; ++k) {
    std::int64_t best = -1;
    for (std::int64_t e = 0; e < n; ++e) {
      bool taken = false;
      for (std::int64_t j = 0; j < k; ++j) taken = taken || out_idx[j] == e;
      if (taken) continue;
      if (best < 0 || ranksBefore(biased[e], e, biased[best], best)) best = e;
    }
    out_idx[k] = static_cast<std::int32_t>(best);
  }
  float sum = 0.0F;
  for (std::int64_t k = 0; k < shape.top_k; ++k) sum += score[out_idx[k]];
  for (std::int64_t k = 0; k < shape.top_k; ++k) out_weight[k] = score[out_idx[k]] / sum * shape.routed_scaling;
}

// ---------------------------------------------------------------------------------------------
// Split-KV attention: each split of the context yields a partial softmax (its maximum score m,
// its sum l of exp(s - m), and o = sum exp(s - m) v unnormalized); partials merge exactly
// (log-sum-exp), in split order.

struct SoftmaxPartial {
  float max = negInfF();  ///< -inf: an empty split
  float sum = 0.0F;
};

/// The factor that moves a partial with maximum `part_max` onto the common maximum `total_max`
/// (0 for an empty partial).
PD_HD float mergeFactor(float part_max, float total_max) {
  return part_max == negInfF() ? 0.0F : expF(part_max - total_max);
}

/// Combines partials [0, n) into the common maximum and normalizer: out.max = max of the maxima,
/// out.sum = sum_i sum_i * mergeFactor(max_i, out.max), accumulated in split order.
PD_HD SoftmaxPartial mergePartials(const SoftmaxPartial* parts, std::int64_t n) {
  SoftmaxPartial out;
  for (std::int64_t i = 0; i < n; ++i) out.max = parts[i].max > out.max ? parts[i].max : out.max;
  for (std::int64_t i = 0; i < n; ++i) out.sum += parts[i].sum * mergeFactor(parts[i].max, out.max);
  return out;
}

/// One output value of the merged attention: sum_i o_i * factor_i / total.sum, in split order.
/// `o` points at split 0's value; consecutive splits are `stride` apart.
PD_HD float mergedOutput(const float* o, std::int64_t stride, const SoftmaxPartial* parts, std::int64_t n,
                         SoftmaxPartial total) {
  float acc = 0.0F;
  for (std::int64_t i = 0; i < n; ++i) acc += o[i * stride] * mergeFactor(parts[i].max, total.max);
  return acc / total.sum;
}

// ---------------------------------------------------------------------------------------------
// Prefill attention (keys and values up-projected from the latents, the context in chunks): the
// running softmax of one (query row, head) across the chunks, in the CPU engine's prefill order
// (engine/src/cpu/cpu_engine.cpp, prefillAttention).

struct RunningSoftmax {
  float max = negInfF();  ///< -inf: no position seen yet
  float sum = 0.0F;
};

/// One chunk of `n` raw scores q.k: scales them by `scale` in place, moves the state to the new
/// maximum (the old sum rescaled by exp(old max - new max) when the maximum moved and the sum is
/// positive), turns the scores into the chunk's weights exp(s - max) and adds them to the sum in
/// position order. Returns the factor the running output must be multiplied by before the
/// chunk's weighted values are added (1 when the maximum did not move).
PD_HD float runningSoftmaxStep(RunningSoftmax& state, float* scores, std::int64_t n, float scale) {
  float mx = state.max;
  for (std::int64_t p = 0; p < n; ++p) {
    scores[p] *= scale;
    mx = scores[p] > mx ? scores[p] : mx;
  }
  float factor = 1.0F;
  if (state.max != mx && state.sum > 0.0F) {
    factor = expF(state.max - mx);
    state.sum *= factor;
  }
  for (std::int64_t p = 0; p < n; ++p) {
    scores[p] = expF(scores[p] - mx);
    state.sum += scores[p];
  }
  state.max = mx;
  return factor;
}

/// One running output value after a chunk: acc * factor, then plus weights[p] * v[p * stride] in
/// position order.
PD_HD float runningOutputStep(float acc, float factor, const float* weights, const float* v, std::int64_t stride,
                              std::int64_t n) {
  acc *= factor;
  for (std::int64_t p = 0; p < n; ++p) acc += weights[p] * v[p * stride];
  return acc;
}

/// The attention output once every chunk is in: acc * (1 / sum), as the CPU engine normalizes.
PD_HD float runningOutputFinal(float acc, const RunningSoftmax& state) {
  return acc * (1.0F / state.sum);
}

// ---------------------------------------------------------------------------------------------
// Sampling (the CPU Sampler's order: penalties, temperature, top-k, top-p, min-p, one draw).

/// The n-th uniform draw in [0, 1) (53 bits) of a request seeded `seed`: splitmix64 of
/// seed + (n + 1) * golden gamma. Counter-based, so draw n needs no state, and it equals the
/// CPU Sampler's n-th draw (n counts the non-greedy tokens sampled so far).
PD_HD double uniformAt(std::uint64_t seed, std::uint64_t n) {
  std::uint64_t z = seed + (n + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

/// A logit after presence / frequency penalties for a token generated `count` (> 0) times.
PD_HD float penalizedLogit(float logit, std::int64_t count, double presence, double frequency) {
  return logit - static_cast<float>(presence + frequency * static_cast<double>(count));
}

/// Words of an allowed-token mask over `vocab` token ids (one bit per id).
PD_HD constexpr std::int64_t maskWords(std::int64_t vocab) {
  return (vocab + 63) / 64;
}

/// Whether an allowed-token mask lets token `id` through: bit id % 64 of word id / 64, the rule
/// of the CPU Sampler's `allowed` (a grammar's mask). A token it refuses gets the logit -inf
/// after the penalties and logit_bias, before the draw.
PD_HD bool tokenAllowed(const std::uint64_t* mask, std::int64_t id) {
  return ((mask[id / 64] >> (id % 64)) & 1U) != 0;
}

/// Whether `mask` (maskWords(vocab) words) allows at least one token id below vocab: bits past
/// the vocabulary in the last word do not count.
PD_HD bool maskAllowsSome(const std::uint64_t* mask, std::int64_t vocab) {
  for (std::int64_t w = 0; w * 64 < vocab; ++w) {
    const std::int64_t valid = vocab - w * 64 < 64 ? vocab - w * 64 : 64;
    const std::uint64_t keep = valid == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << valid) - 1;
    if ((mask[w] & keep) != 0) return true;
  }
  return false;
}

/// The unnormalized probability of a logit at temperature 1 / inv_t, relative to the maximum.
PD_HD double temperatureWeight(float logit, float max_logit, double inv_t) {
  return expD((static_cast<double>(logit) - max_logit) * inv_t);
}

struct SamplingTransform {
  double inv_temperature = 1.0;  ///< > 0 (greedy does not come here)
  std::int64_t top_k = 0;        ///< 0 = none
  double top_p = 1.0;
  double min_p = 0.0;
  [[nodiscard]] PD_HD bool filtered() const { return top_k > 0 || top_p < 1.0 || min_p > 0.0; }
};

/// Draws a token from `logits` [vocab] (penalties already applied) with uniform `u`. Without
/// filters `order` is unused and tokens are scanned in id order; with filters `order` [vocab] is
/// the ids sorted by descending logit (lower id on ties). Serial by design: the same additions in
/// the same order as the CPU Sampler, so both pick the same token for the same u.
PD_HD std::int32_t drawToken(const float* logits, std::int64_t vocab, const std::int32_t* order,
                             const SamplingTransform& t, double u) {
  if (!t.filtered()) {
    float mx = logits[0];
    for (std::int64_t i = 1; i < vocab; ++i) mx = logits[i] > mx ? logits[i] : mx;
    double total = 0.0;
    for (std::int64_t i = 0; i < vocab; ++i) total += temperatureWeight(logits[i], mx, t.inv_temperature);
    const double target = u * total;
    double acc = 0.0;
    std::int32_t last_possible = 0;  // where rounding leaves acc <= target: the last token with weight
    for (std::int64_t i = 0; i < vocab; ++i) {
      const double w = temperatureWeight(logits[i], mx, t.inv_temperature);
      if (w > 0.0) last_possible = static_cast<std::int32_t>(i);
      acc += w;
      if (acc > target) return static_cast<std::int32_t>(i);
    }
    return last_possible;
  }
  const float mx = logits[order[0]];
  const auto prob = [&](std::int64_t i) { return temperatureWeight(logits[order[i]], mx, t.inv_temperature); };
  std::int64_t keep = (t.top_k > 0 && t.top_k < vocab) ? t.top_k : vocab;
  if (t.top_p < 1.0) {
    double total = 0.0;
    for (std::int64_t i = 0; i < keep; ++i) total += prob(i);
    double acc = 0.0;
    std::int64_t i = 0;
    for (; i < keep; ++i) {
      acc += prob(i);
      if (acc >= t.top_p * total) break;
    }
    keep = keep < i + 1 ? keep : i + 1;
  }
  if (t.min_p > 0.0) {
    const double min_weight = t.min_p * prob(0);
    std::int64_t i = 1;
    while (i < keep && prob(i) >= min_weight) ++i;
    keep = i;
  }
  double total = 0.0;
  for (std::int64_t i = 0; i < keep; ++i) total += prob(i);
  const double target = u * total;
  while (keep > 1 && prob(keep - 1) == 0.0) --keep;  // masked tokens have no weight
  double acc = 0.0;
  for (std::int64_t i = 0; i < keep; ++i) {
    acc += prob(i);
    if (acc > target) return order[i];
  }
  return order[keep - 1];
}

// ---------------------------------------------------------------------------------------------
// FP8 GEMV: y[r] = sum_c W[r][c] x[c] for a block-scaled FP8 W. One warp per row: lane l covers
// columns [tile * 128 + 4 l, tile * 128 + 4 l + 4) of every 128-column tile (one scale block
// wide), accumulating with fma in column order; the 32 lane sums then meet in a butterfly
// (xor 16, 8, 4, 2, 1), the order __shfl_xor_sync gives.

constexpr int kGemvWarp = 32;
constexpr int kGemvColsPerLane = 4;
constexpr std::int64_t kGemvTileCols = std::int64_t{kGemvWarp} * kGemvColsPerLane;  // 128

/// Lane `lane`'s partial sum of row `q_row` [cols] (scales `scale_row` [scale_cols], this row's
/// block row) against x [cols].
PD_HD float fp8GemvLanePartial(const std::uint8_t* q_row, const float* scale_row, std::int64_t cols,
                               std::int64_t block_cols, const float* x, int lane) {
  float acc = 0.0F;
  for (std::int64_t tile = 0; tile * kGemvTileCols < cols; ++tile) {
    const std::int64_t c0 = tile * kGemvTileCols + static_cast<std::int64_t>(lane) * kGemvColsPerLane;
    for (int i = 0; i < kGemvColsPerLane; ++i) {
      const std::int64_t c = c0 + i;
      if (c < cols) acc = fmaF(fp8BlockScaledValue(q_row[c], scale_row[c / block_cols]), x[c], acc);
    }
  }
  return acc;
}

/// The butterfly over 32 lane values, on the host (the kernel does it with shuffles): after the
/// steps xor 16 .. 1 every lane holds the same sum; returns lane 0's.
PD_HD float butterflySum32(const float* lanes) {
  float v[kGemvWarp];
  for (int l = 0; l < kGemvWarp; ++l) v[l] = lanes[l];
  for (int offset = kGemvWarp / 2; offset > 0; offset /= 2) {
    float next[kGemvWarp];
    for (int l = 0; l < kGemvWarp; ++l) next[l] = v[l] + v[l ^ offset];
    for (int l = 0; l < kGemvWarp; ++l) v[l] = next[l];
  }
  return v[0];
}

/// One output of the FP8 GEMV exactly as the kernel computes it.
PD_HD float fp8GemvRow(const std::uint8_t* q_row, const float* scale_row, std::int64_t cols, std::int64_t block_cols,
                       const float* x) {
  float lanes[kGemvWarp];
  for (int l = 0; l < kGemvWarp; ++l) lanes[l] = fp8GemvLanePartial(q_row, scale_row, cols, block_cols, x, l);
  return butterflySum32(lanes);
}

// ---------------------------------------------------------------------------------------------
// Top-n logprobs: the n most likely tokens of a row of raw logits, in the CPU Sampler's order
// (larger logit first, lower id on ties: ranksBefore, a total order over (value, id)).

/// The candidate of raw[first], raw[first + stride], ... below `end` that ranks first among
/// those ranked after (prev_v, prev_id) (prev_id < 0: every candidate); -1 when there is none.
/// Shares of one row's scan may be split across threads and reduced with ranksBefore in any
/// order: the result is the same.
PD_HD std::int64_t bestAfter(const float* raw, std::int64_t first, std::int64_t end, std::int64_t stride, float prev_v,
                             std::int64_t prev_id) {
  std::int64_t best = -1;
  for (std::int64_t i = first; i < end; i += stride) {
    if (prev_id >= 0 && !ranksBefore(prev_v, prev_id, raw[i], i)) continue;
    if (best < 0 || ranksBefore(raw[i], i, raw[best], best)) best = i;
  }
  return best;
}

/// ids [n]: the n first tokens of raw [vocab] in that order (n <= vocab), by n passes of
/// bestAfter, as the kernel runs them (one pass per entry).
PD_HD void topTokens(const float* raw, std::int64_t vocab, std::int64_t n, std::int32_t* ids) {
  float prev_v = 0.0F;
  std::int64_t prev_id = -1;
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t best = bestAfter(raw, 0, vocab, 1, prev_v, prev_id);
    ids[k] = static_cast<std::int32_t>(best);
    if (best < 0) continue;
    prev_v = raw[best];
    prev_id = best;
  }
}

/// A token's logprob under the raw distribution: logit - log-sum-exp, in double, as the CPU
/// Sampler computes it.
PD_HD float rawLogprob(float logit, double lse) {
  return static_cast<float>(static_cast<double>(logit) - lse);
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMV (the MoE experts on the device, no host round trip): expert g multiplies the rows
// of its slots [offsets[g], offsets[g + 1]) by its own weight matrix, stored FP32 (the fp32
// mode's copies), BF16 (multiplied as stored in the bf16 mode, inputs rounded to BF16) or FP8
// with block scales. Lanes and the butterfly are the FP8 GEMV's above.

enum class GemvWeights : int { F32 = 0, Bf16 = 1, Fp8 = 2 };

/// Weight [row][c] of a matrix of `cols` columns stored as `kind`; `scale_row` is the row's block
/// row of scales (FP8 only).
PD_HD float gemvWeightAt(GemvWeights kind, const void* w, const float* scale_row, std::int64_t row, std::int64_t cols,
                         std::int64_t c, std::int64_t block_cols) {
  const std::int64_t at = row * cols + c;
  if (kind == GemvWeights::F32) return static_cast<const float*>(w)[at];
  if (kind == GemvWeights::Bf16) return bf16Decode(static_cast<const std::uint16_t*>(w)[at]);
  return fp8BlockScaledValue(static_cast<const std::uint8_t*>(w)[at], scale_row[c / block_cols]);
}

/// An input value as the grouped GEMV multiplies it: rounded to BF16 against BF16 weights (the
/// bf16 mode's rule for every BF16 linear), as is otherwise.
PD_HD float gemvInput(GemvWeights kind, float x) {
  return kind == GemvWeights::Bf16 ? bf16Round(x) : x;
}

/// Lane `lane`'s partial sum of weight row `row` against x [cols].
PD_HD float gemvLanePartial(GemvWeights kind, const void* w, const float* scale_row, std::int64_t row,
                            std::int64_t cols, std::int64_t block_cols, const float* x, int lane) {
  float acc = 0.0F;
  for (std::int64_t tile = 0; tile * kGemvTileCols < cols; ++tile) {
    const std::int64_t c0 = tile * kGemvTileCols + static_cast<std::int64_t>(lane) * kGemvColsPerLane;
    for (int i = 0; i < kGemvColsPerLane; ++i) {
      const std::int64_t c = c0 + i;
      if (c < cols) acc = fmaF(gemvWeightAt(kind, w, scale_row, row, cols, c, block_cols), gemvInput(kind, x[c]), acc);
    }
  }
  return acc;
}

/// One output of the grouped GEMV exactly as the kernel computes it.
PD_HD float gemvRow(GemvWeights kind, const void* w, const float* scale_row, std::int64_t row, std::int64_t cols,
                    std::int64_t block_cols, const float* x) {
  float lanes[kGemvWarp];
  for (int l = 0; l < kGemvWarp; ++l) lanes[l] = gemvLanePartial(kind, w, scale_row, row, cols, block_cols, x, l);
  return butterflySum32(lanes);
}

// ---------------------------------------------------------------------------------------------
// MoE token grouping and combine, as the CPU engine's moe() does them on the host.

/// Groups the `slots` (token, k) choices `chosen` [slots] by expert: expert e's rows are
/// [offsets[e], offsets[e + 1]) (offsets [experts + 1]), in ascending slot order, and slot i's row
/// is slot_of[i]. When a chosen id is outside [0, experts) nothing is grouped (offsets all 0,
/// slot_of all -1) and false is returned. One thread; O(slots + experts).
PD_HD bool groupByExpert(const std::int32_t* chosen, std::int64_t slots, std::int64_t experts, std::int32_t* offsets,
                         std::int32_t* slot_of) {
  bool ok = true;
  for (std::int64_t i = 0; i < slots; ++i) ok = ok && chosen[i] >= 0 && chosen[i] < experts;
  for (std::int64_t e = 0; e <= experts; ++e) offsets[e] = 0;
  if (!ok) {
    for (std::int64_t i = 0; i < slots; ++i) slot_of[i] = -1;
    return false;
  }
  for (std::int64_t i = 0; i < slots; ++i) ++offsets[chosen[i] + 1];
  for (std::int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  // offsets[e] is now expert e's next free row; filling moves it to e's end, e + 1's begin.
  for (std::int64_t i = 0; i < slots; ++i) slot_of[i] = offsets[chosen[i]]++;
  for (std::int64_t e = experts; e > 0; --e) offsets[e] = offsets[e - 1];
  offsets[0] = 0;
  return true;
}

/// How many experts got at least one row from groupByExpert's offsets [experts + 1].
PD_HD std::int32_t expertsWithRows(const std::int32_t* offsets, std::int64_t experts) {
  std::int32_t used = 0;
  for (std::int64_t e = 0; e < experts; ++e) used += offsets[e + 1] > offsets[e] ? 1 : 0;
  return used;
}

/// Output column j of one token's MoE block: its top_k experts' outputs (gout rows slot_row[k],
/// width d) weighted by weight_row[k], accumulated with fma in ascending expert id order (the
/// CPU engine's order), then + shared_row[j] when shared_row is not null. A slot of -1 (a failed
/// grouping) adds nothing.
PD_HD float moeCombine(const std::int32_t* chosen_row, const float* weight_row, const std::int32_t* slot_row,
                       std::int64_t top_k, const float* gout, std::int64_t d, std::int64_t j, const float* shared_row) {
  float acc = 0.0F;
  std::int64_t last = -1;  // the expert id added last; ids of one token are distinct
  for (std::int64_t n = 0; n < top_k; ++n) {
    std::int64_t pick = -1;
    for (std::int64_t k = 0; k < top_k; ++k) {
      const std::int64_t id = chosen_row[k];
      if (id > last && (pick < 0 || id < chosen_row[pick])) pick = k;
    }
    if (pick < 0) break;
    last = chosen_row[pick];
    if (slot_row[pick] >= 0) acc = fmaF(weight_row[pick], gout[static_cast<std::int64_t>(slot_row[pick]) * d + j], acc);
  }
  if (shared_row != nullptr) acc = acc + shared_row[j];
  return acc;
}

}  // namespace pd::gpu::math
