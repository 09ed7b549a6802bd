// The layer kernels: axpy (smoke), RMSNorm with fused residual add, interleaved RoPE, absorbed
// MLA decode attention (split-KV + combine), noaux_tc routing and the FP8 block-scaled GEMV.
// Naive on purpose (docs/gpu.md): obvious indexing, the arithmetic in device_math.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <cassert>

#include "gpu_kernels.h"

namespace pd::gpu::kernels {
namespace {

namespace m = ::pd::gpu::math;

constexpr int kAxpyThreads = 256;

__global__ void __launch_bounds__(kAxpyThreads) axpyKernel(float a, const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}

// grid-stride over rows * cols; element i is row i / cols, column i % cols.
__global__ void __launch_bounds__(kAxpyThreads)
    rowsToBf16Kernel(const float* x, std::int64_t x_stride, std::int64_t rows, std::int64_t cols, std::uint16_t* out) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / cols;
    const std::int64_t c = i - r * cols;
    out[i] = m::bf16Encode(x[r * x_stride + c]);
  }
}

// grid-stride over n (n may exceed a grid's reach).
__global__ void __launch_bounds__(kAxpyThreads) siluMulKernel(float* gate, const float* up, std::int64_t n) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    gate[i] = m::siluMul(gate[i], up[i]);
  }
}

__global__ void __launch_bounds__(kAxpyThreads) roundToBf16Kernel(float* x, std::int64_t n) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    x[i] = m::bf16Round(x[i]);
  }
}

// One thread per (row, tile of kKvFp8Tile values): row r's latent src[r] encoded into FP8 token
// slots[r] of dst (pd/common/kv_format.h); the thread of tile 0 also zeroes the padding.
__global__ void __launch_bounds__(kAxpyThreads)
    scatterRowsKvFp8Kernel(const float* src, std::int64_t rows, const std::int64_t* slots, std::uint8_t* dst, int d) {
  const std::int64_t tiles = (d + m::kKvFp8Tile - 1) / m::kKvFp8Tile;
  const std::int64_t token_bytes = m::kvFp8TokenBytes(d);
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * tiles;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / tiles;
    const int tile = static_cast<int>(i % tiles);
    std::uint8_t* token = dst + slots[row] * token_bytes;
    m::kvFp8EncodeTile(src + row * d, d, tile, token);
    if (tile == 0) m::kvFp8ZeroPadding(d, token);
  }
}

// ---- RMSNorm ---------------------------------------------------------------------------------

constexpr int kNormThreads = 256;

// One block per row; the sum of squares in double (as the CPU engine), tree-reduced.
__global__ void __launch_bounds__(kNormThreads)
    rmsNormKernel(float* h, const float* delta, const float* weight, float* out, int d, std::int64_t h_stride,
                  std::int64_t out_stride, float eps) {
  __shared__ double partial[kNormThreads];
  float* row = h + static_cast<std::int64_t>(blockIdx.x) * h_stride;
  double ss = 0.0;
  for (int i = threadIdx.x; i < d; i += kNormThreads) {
    float v = row[i];
    if (delta != nullptr) {
      v += delta[static_cast<std::int64_t>(blockIdx.x) * h_stride + i];
      row[i] = v;
    }
    ss += static_cast<double>(v) * v;
  }
  partial[threadIdx.x] = ss;
  __syncthreads();
  for (int width = kNormThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  const float inv = m::rmsInverse(partial[0], d, eps);
  float* o = out + static_cast<std::int64_t>(blockIdx.x) * out_stride;
  for (int i = threadIdx.x; i < d; i += kNormThreads) o[i] = m::rmsNormValue(row[i], inv, weight[i]);
}

// ---- RoPE ------------------------------------------------------------------------------------

constexpr int kRopeThreads = 64;

// blockIdx.x = row * heads + head; thread j rotates pair j.
__global__ void __launch_bounds__(kRopeThreads)
    ropeKernel(float* x, int heads, std::int64_t row_stride, std::int64_t head_stride, std::int64_t offset,
               const float* inv_freq, int half, const std::int64_t* positions) {
  const int row = blockIdx.x / heads;
  const int head = blockIdx.x % heads;
  float* base = x + row * row_stride + head * head_stride + offset;
  for (int j = threadIdx.x; j < half; j += kRopeThreads) {
    const float angle = m::ropeAngle(positions[row], inv_freq[j]);
    m::ropeRotatePair(base[2 * j], base[2 * j + 1], m::cosF(angle), m::sinF(angle));
  }
}

// ---- MLA decode attention --------------------------------------------------------------------

constexpr int kMlaThreads = 128;
constexpr int kMlaWarps = kMlaThreads / 32;

// Value `dim` of the latent in cache slot `slot` of a layer: F32, BF16, or an FP8 token (its code
// times its tile's scale).
__device__ float cachedLatent(const void* layer, bool bf16, bool fp8, int latent_dim, std::int64_t slot, int dim) {
  if (fp8) {
    const auto* token = static_cast<const std::uint8_t*>(layer) + slot * m::kvFp8TokenBytes(latent_dim);
    return m::kvFp8At(token, latent_dim, dim);
  }
  const std::int64_t index = slot * latent_dim + dim;
  if (bf16) return m::bf16Decode(static_cast<const std::uint16_t*>(layer)[index]);
  return static_cast<const float*>(layer)[index];
}

__device__ float latentAt(const MlaDecodeArgs& a, std::int32_t block, int offset, int dim) {
  return cachedLatent(a.cache_layer, a.cache_bf16, a.cache_fp8, a.latent_dim,
                      static_cast<std::int64_t>(block) * a.block_size + offset, dim);
}

// grid (tokens * heads, splits): one block per (query token, head, split of the context).
__global__ void __launch_bounds__(kMlaThreads) mlaSplitKernel(MlaDecodeArgs a) {
  extern __shared__ float smem[];
  float* q = smem;                      // [latent_dim]
  float* scores = smem + a.latent_dim;  // [kMlaSplitPositions]
  const int bh = blockIdx.x;
  const int t = bh / a.heads;
  const int split = blockIdx.y;
  const std::int64_t ctx = a.ctx_len[t];
  const std::int64_t p0 = static_cast<std::int64_t>(split) * kMlaSplitPositions;
  const std::int64_t p1 = p0 + kMlaSplitPositions < ctx ? p0 + kMlaSplitPositions : ctx;
  m::SoftmaxPartial* part = a.parts + static_cast<std::int64_t>(bh) * a.splits + split;
  float* po = a.part_o + (static_cast<std::int64_t>(bh) * a.splits + split) * a.latent_dim;
  if (p0 >= p1) {  // an empty split (the whole block takes this branch)
    if (threadIdx.x == 0) *part = m::SoftmaxPartial{};
    for (int i = threadIdx.x; i < a.latent_dim; i += kMlaThreads) po[i] = 0.0F;
    return;
  }
  const float* qsrc = a.q_cat + static_cast<std::int64_t>(bh) * a.latent_dim;
  for (int i = threadIdx.x; i < a.latent_dim; i += kMlaThreads) q[i] = qsrc[i];
  __syncthreads();
  const std::int32_t* table = a.block_tables + a.table_begin[t];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (std::int64_t p = p0 + warp; p < p1; p += kMlaWarps) {
    const std::int32_t block = table[p / a.block_size];
    assert(block >= 0 && block < a.num_blocks);
    const int offset = static_cast<int>(p % a.block_size);
    float dot = 0.0F;
    for (int i = lane; i < a.latent_dim; i += 32) dot += q[i] * latentAt(a, block, offset, i);
    for (int width = 16; width > 0; width /= 2) dot += __shfl_xor_sync(0xFFFFFFFFU, dot, width);
    if (lane == 0) scores[p - p0] = dot * a.scale;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float mx = m::negInfF();
    for (std::int64_t p = p0; p < p1; ++p) mx = scores[p - p0] > mx ? scores[p - p0] : mx;
    float sum = 0.0F;
    for (std::int64_t p = p0; p < p1; ++p) {
      scores[p - p0] = m::expF(scores[p - p0] - mx);
      sum += scores[p - p0];
    }
    *part = m::SoftmaxPartial{mx, sum};
  }
  __syncthreads();
  for (int i = threadIdx.x; i < a.latent_dim; i += kMlaThreads) {
    float acc = 0.0F;
    for (std::int64_t p = p0; p < p1; ++p) {
      acc += scores[p - p0] * latentAt(a, table[p / a.block_size], static_cast<int>(p % a.block_size), i);
    }
    po[i] = acc;
  }
}

// One block per (token, head): merges its splits in split order.
__global__ void __launch_bounds__(kMlaThreads) mlaCombineKernel(MlaDecodeArgs a) {
  const int bh = blockIdx.x;
  const m::SoftmaxPartial* parts = a.parts + static_cast<std::int64_t>(bh) * a.splits;
  const m::SoftmaxPartial total = m::mergePartials(parts, a.splits);
  const float* po = a.part_o + static_cast<std::int64_t>(bh) * a.splits * a.latent_dim;
  for (int i = threadIdx.x; i < a.latent_dim; i += kMlaThreads) {
    a.out[static_cast<std::int64_t>(bh) * a.latent_dim + i] =
        m::mergedOutput(po + i, a.latent_dim, parts, a.splits, total);
  }
}

// ---- MLA prefill attention (up-projected keys and values) ------------------------------------

constexpr int kPrefillThreads = 128;
constexpr int kPrefillWarps = kPrefillThreads / 32;

// One block per position of the chunk; threads over the latent dimensions.
__global__ void __launch_bounds__(kPrefillThreads) gatherLatentsKernel(GatherLatentsArgs a) {
  const std::int64_t p = a.first + blockIdx.x;
  const std::int32_t block = a.table[p / a.block_size];
  assert(block >= 0 && block < a.num_blocks);
  const std::int64_t slot = static_cast<std::int64_t>(block) * a.block_size + p % a.block_size;
  float* out = a.out + static_cast<std::int64_t>(blockIdx.x) * a.latent_dim;
  for (int i = threadIdx.x; i < a.latent_dim; i += kPrefillThreads) {
    out[i] = cachedLatent(a.cache_layer, a.cache_bf16, a.cache_fp8, a.latent_dim, slot, i);
  }
}

// grid (rows, heads): one block per (query row, head). Scores by one warp per position, the
// running softmax by one thread (math::runningSoftmaxStep), the output by one thread per value
// dimension (math::runningOutputStep).
__global__ void __launch_bounds__(kPrefillThreads) mlaPrefillChunkKernel(MlaPrefillChunkArgs a) {
  extern __shared__ float smem[];
  const int qk = a.nope + a.rope;
  float* q = smem;                             // [qk]
  float* weights = smem + qk;                  // [kMlaPrefillChunk]
  float* factor = weights + kMlaPrefillChunk;  // [1]
  const int t = blockIdx.x;
  const int h = blockIdx.y;
  const std::int64_t ctx = a.ctx_len[t];
  const std::int64_t end = a.first + a.count < ctx ? a.first + a.count : ctx;
  const int n = end > a.first ? static_cast<int>(end - a.first) : 0;
  if (n == 0) return;  // causal: this row sees none of the chunk (the whole block returns)
  const std::int64_t th = static_cast<std::int64_t>(t) * a.heads + h;
  const float* qsrc = a.q + th * qk;
  for (int i = threadIdx.x; i < qk; i += kPrefillThreads) q[i] = qsrc[i];
  __syncthreads();
  const int kvw = a.heads * (a.nope + a.v);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int p = warp; p < n; p += kPrefillWarps) {
    const float* k = a.kv + static_cast<std::int64_t>(p) * kvw + static_cast<std::int64_t>(h) * (a.nope + a.v);
    const float* pe = a.latents + static_cast<std::int64_t>(p) * a.latent_dim + a.rank;
    float dot = 0.0F;
    for (int i = lane; i < a.nope; i += 32) dot += q[i] * k[i];
    for (int i = lane; i < a.rope; i += 32) dot += q[a.nope + i] * pe[i];
    for (int width = 16; width > 0; width /= 2) dot += __shfl_xor_sync(0xFFFFFFFFU, dot, width);
    if (lane == 0) weights[p] = dot;
  }
  __syncthreads();
  if (threadIdx.x == 0) *factor = m::runningSoftmaxStep(a.state[th], weights, n, a.scale);
  __syncthreads();
  const float f = *factor;
  const float* v0 = a.kv + static_cast<std::int64_t>(h) * (a.nope + a.v) + a.nope;
  float* acc = a.acc + th * a.v;
  for (int i = threadIdx.x; i < a.v; i += kPrefillThreads)
    acc[i] = m::runningOutputStep(acc[i], f, weights, v0 + i, kvw, n);
}

__global__ void __launch_bounds__(kAxpyThreads)
    mlaPrefillResetKernel(m::RunningSoftmax* state, float* acc, std::int64_t n, int v) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) state[i] = m::RunningSoftmax{};
  if (i < n * v) acc[i] = 0.0F;
}

__global__ void __launch_bounds__(kAxpyThreads)
    mlaPrefillFinishKernel(const m::RunningSoftmax* state, const float* acc, std::int64_t n, int v, float* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n * v) out[i] = m::runningOutputFinal(acc[i], state[i / v]);
}

// ---- routing ---------------------------------------------------------------------------------

// One block per token; one thread routes it serially (naive; the arithmetic is shared).
__global__ void routeKernel(const float* logits, const float* bias, m::RoutingShape shape, std::int32_t* idx,
                            float* weight) {
  __shared__ float score[m::kMaxRoutedExperts];
  __shared__ float biased[m::kMaxRoutedExperts];
  __shared__ float group_score[m::kMaxExpertGroups];
  if (threadIdx.x != 0) return;
  const std::int64_t t = blockIdx.x;
  m::routeNoauxTc(logits + t * shape.experts, bias, shape, score, biased, group_score, idx + t * shape.top_k,
                  weight + t * shape.top_k);
}

// ---- FP8 GEMV --------------------------------------------------------------------------------

constexpr int kGemvThreads = 128;
constexpr int kGemvRowsPerBlock = kGemvThreads / m::kGemvWarp;
constexpr int kGemvTokensPerPass = 8;
static_assert(m::kGemvWarp == 32, "the butterfly below is a full warp");

// One warp: weight row `row` (of a matrix stored as `kind`) against `count` rows of x, into y.
// Tokens in passes of kGemvTokensPerPass (each pass re-reads the weight row, from L2 after the
// first). Lane partials and the butterfly are those of math::gemvRow (math::fp8GemvRow for FP8).
__device__ void gemvWarpRows(m::GemvWeights kind, const void* w, const float* scale_row, int row, int cols,
                             int block_cols, const float* x, std::int64_t x_stride, int count, float* y,
                             std::int64_t y_stride, int lane) {
  for (int t0 = 0; t0 < count; t0 += kGemvTokensPerPass) {
    float acc[kGemvTokensPerPass];
    for (int k = 0; k < kGemvTokensPerPass; ++k) acc[k] = 0.0F;
    for (std::int64_t tile = 0; tile * m::kGemvTileCols < cols; ++tile) {
      const std::int64_t c0 = tile * m::kGemvTileCols + static_cast<std::int64_t>(lane) * m::kGemvColsPerLane;
      for (int i = 0; i < m::kGemvColsPerLane; ++i) {
        const std::int64_t c = c0 + i;
        if (c >= cols) continue;
        const float wv = m::gemvWeightAt(kind, w, scale_row, row, cols, c, block_cols);
        for (int k = 0; k < kGemvTokensPerPass; ++k) {
          if (t0 + k < count) acc[k] = m::fmaF(wv, m::gemvInput(kind, x[(t0 + k) * x_stride + c]), acc[k]);
        }
      }
    }
    for (int k = 0; k < kGemvTokensPerPass; ++k) {
      float v = acc[k];
      for (int width = m::kGemvWarp / 2; width > 0; width /= 2) v = v + __shfl_xor_sync(0xFFFFFFFFU, v, width);
      if (lane == 0 && t0 + k < count) y[(t0 + k) * y_stride + row] = v;
    }
  }
}

// One warp per row of the FP8 matrix.
__global__ void __launch_bounds__(kGemvThreads) fp8GemvKernel(Fp8GemvArgs a) {
  const int row = blockIdx.x * kGemvRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.rows) return;  // the whole warp leaves together
  const float* scale_row = a.scale_inv + static_cast<std::int64_t>(row / a.block_rows) * a.scale_cols;
  gemvWarpRows(m::GemvWeights::Fp8, a.q, scale_row, row, a.cols, a.block_cols, a.x, a.x_stride, a.tokens, a.y,
               a.y_stride, lane);
}

// Grouped GEMV: blockIdx.y is the group (expert), one warp per row, over the group's rows
// [offsets[g], offsets[g + 1]) of x. A group with no rows leaves at once.
__global__ void __launch_bounds__(kGemvThreads) groupedGemvKernel(GroupedGemvArgs a) {
  const int g = blockIdx.y;
  const int row = blockIdx.x * kGemvRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int begin = a.offsets[g];
  const int count = a.offsets[g + 1] - begin;
  if (row >= a.rows || count <= 0) return;  // uniform per warp
  const float* scale_row = a.kind == m::GemvWeights::Fp8
                               ? a.scales[g] + static_cast<std::int64_t>(row / a.block_rows) * a.scale_cols
                               : nullptr;
  gemvWarpRows(a.kind, a.weights[g], scale_row, row, a.cols, a.block_cols,
               a.x + static_cast<std::int64_t>(begin) * a.x_stride, a.x_stride, count,
               a.y + static_cast<std::int64_t>(begin) * a.y_stride, a.y_stride, lane);
}

// blockIdx.x is the output row; threads stride over its columns.
__global__ void __launch_bounds__(kAxpyThreads)
    gatherRowsKernel(const float* table, std::int64_t first_id, std::int64_t table_rows, const std::int32_t* ids,
                     const std::uint8_t* zero, int d, float* out) {
  const std::int64_t r = blockIdx.x;
  float* dst = out + r * d;
  const std::int64_t row = static_cast<std::int64_t>(ids[r]) - first_id;
  // Zeroed rows, and ids of another rank's vocabulary shard (or, defensively, outside the table).
  if ((zero != nullptr && zero[r] != 0) || row < 0 || row >= table_rows) {
    for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = 0.0F;
    return;
  }
  const float* src = table + row * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
}

// blockIdx.x is the source row; threads stride over its columns.
__global__ void __launch_bounds__(kAxpyThreads)
    scatterRowsKernel(const float* src, const std::int64_t* slots, int d, float* dst) {
  const std::int64_t r = blockIdx.x;
  const float* from = src + r * d;
  float* to = dst + slots[r] * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) to[j] = from[j];
}

__global__ void __launch_bounds__(kAxpyThreads)
    scatterRowsBf16Kernel(const float* src, const std::int64_t* slots, int d, std::uint16_t* dst) {
  const std::int64_t r = blockIdx.x;
  const float* from = src + r * d;
  std::uint16_t* to = dst + slots[r] * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) to[j] = m::bf16Encode(from[j]);
}

// One thread: the grouping is a counting sort of at most kMaxDecodeBatch * top_k slots.
__global__ void moeGroupKernel(const std::int32_t* chosen, int slots, int experts, std::int32_t* offsets,
                               std::int32_t* slot_of, std::int32_t* failed, std::int32_t* used) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  if (!m::groupByExpert(chosen, slots, experts, offsets, slot_of)) *failed = 1;
  if (used != nullptr) *used = m::expertsWithRows(offsets, experts);
}

// blockIdx.x is the slot; threads stride over the row.
__global__ void __launch_bounds__(kAxpyThreads)
    moeGatherKernel(const float* x, const std::int32_t* slot_of, int top_k, int d, float* gx) {
  const int i = blockIdx.x;
  const std::int32_t slot = slot_of[i];
  if (slot < 0) return;
  const float* src = x + static_cast<std::int64_t>(i / top_k) * d;
  float* dst = gx + static_cast<std::int64_t>(slot) * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
}

// blockIdx.x is the token; threads stride over the row's columns.
__global__ void __launch_bounds__(kAxpyThreads)
    moeCombineKernel(const std::int32_t* chosen, const float* weight, const std::int32_t* slot_of, int top_k,
                     const float* gout, int d, const float* shared, float* out) {
  const std::int64_t t = blockIdx.x;
  const std::int64_t at = t * top_k;
  const float* shared_row = shared == nullptr ? nullptr : shared + t * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    out[t * d + j] = m::moeCombine(chosen + at, weight + at, slot_of + at, top_k, gout, d, j, shared_row);
  }
}

constexpr int kStreamReadThreads = 512;

// One 16-byte load per word; the XOR of a block's words goes to sink[block] (block-reduced
// through shared memory by thread 0's warp).
__global__ void __launch_bounds__(kStreamReadThreads)
    streamReadKernel(const uint4* data, std::size_t count, unsigned int* sink) {
  unsigned int acc = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint4 v = __ldcs(data + i);  // streaming load: evict first, the data is read once
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int width = 16; width > 0; width /= 2) acc ^= __shfl_xor_sync(0xFFFFFFFFU, acc, width);
  __shared__ unsigned int warp_acc[kStreamReadThreads / 32];
  if (threadIdx.x % 32 == 0) warp_acc[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int block_acc = 0;
    for (int w = 0; w < kStreamReadThreads / 32; ++w) block_acc ^= warp_acc[w];
    sink[blockIdx.x] = block_acc;
  }
}

__global__ void fillBf16Kernel(std::uint16_t* data, std::size_t count, std::uint32_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    // An integer hash of (seed, i) to a float in [-1, 1), rounded to BF16.
    std::uint32_t h = static_cast<std::uint32_t>(i) * 0x9E3779B1U ^ seed ^ static_cast<std::uint32_t>(i >> 32);
    h ^= h >> 16;
    h *= 0x85EBCA6BU;
    h ^= h >> 13;
    const float value = static_cast<float>(h >> 8) * (2.0F / 16777216.0F) - 1.0F;
    data[i] = m::bf16Encode(value);
  }
}

}  // namespace

cudaError_t launchStreamRead(const uint4* data, std::size_t count, unsigned int* sink, cudaStream_t stream) {
  streamReadKernel<<<kStreamReadBlocks, kStreamReadThreads, 0, stream>>>(data, count, sink);
  return cudaGetLastError();
}

cudaError_t launchFillBf16(std::uint16_t* data, std::size_t count, std::uint32_t seed, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  fillBf16Kernel<<<1024, 256, 0, stream>>>(data, count, seed);
  return cudaGetLastError();
}

cudaError_t launchAxpy(float a, const float* x, float* y, int n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  axpyKernel<<<(n + kAxpyThreads - 1) / kAxpyThreads, kAxpyThreads, 0, stream>>>(a, x, y, n);
  return cudaGetLastError();
}

cudaError_t launchRowsToBf16(const float* x, std::int64_t x_stride, std::int64_t rows, std::int64_t cols,
                             std::uint16_t* out, cudaStream_t stream) {
  const std::int64_t n = rows * cols;
  if (n <= 0) return cudaSuccess;
  const std::int64_t blocks = std::min<std::int64_t>((n + kAxpyThreads - 1) / kAxpyThreads, 4096);
  rowsToBf16Kernel<<<static_cast<unsigned int>(blocks), kAxpyThreads, 0, stream>>>(x, x_stride, rows, cols, out);
  return cudaGetLastError();
}

cudaError_t launchSiluMul(float* gate, const float* up, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const std::int64_t blocks = std::min<std::int64_t>((n + kAxpyThreads - 1) / kAxpyThreads, 65535);
  siluMulKernel<<<static_cast<unsigned int>(blocks), kAxpyThreads, 0, stream>>>(gate, up, n);
  return cudaGetLastError();
}

cudaError_t launchRoundToBf16(float* x, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const std::int64_t blocks = std::min<std::int64_t>((n + kAxpyThreads - 1) / kAxpyThreads, 65535);
  roundToBf16Kernel<<<static_cast<unsigned int>(blocks), kAxpyThreads, 0, stream>>>(x, n);
  return cudaGetLastError();
}

cudaError_t launchScatterRowsKvFp8(const float* src, std::int64_t rows, const std::int64_t* slots, std::uint8_t* dst,
                                   int d, cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return cudaSuccess;
  const std::int64_t threads = rows * ((d + m::kKvFp8Tile - 1) / m::kKvFp8Tile);
  const std::int64_t blocks = std::min<std::int64_t>((threads + kAxpyThreads - 1) / kAxpyThreads, 65535);
  scatterRowsKvFp8Kernel<<<static_cast<unsigned int>(blocks), kAxpyThreads, 0, stream>>>(src, rows, slots, dst, d);
  return cudaGetLastError();
}

cudaError_t launchRmsNormResidual(float* h, const float* delta, const float* weight, float* out, int rows, int d,
                                  std::int64_t h_stride, std::int64_t out_stride, float eps, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  rmsNormKernel<<<rows, kNormThreads, 0, stream>>>(h, delta, weight, out, d, h_stride, out_stride, eps);
  return cudaGetLastError();
}

cudaError_t launchRopeInterleaved(float* x, int rows, int heads, std::int64_t row_stride, std::int64_t head_stride,
                                  std::int64_t offset, const float* inv_freq, int half, const std::int64_t* positions,
                                  cudaStream_t stream) {
  if (rows <= 0 || heads <= 0) return cudaSuccess;
  ropeKernel<<<rows * heads, kRopeThreads, 0, stream>>>(x, heads, row_stride, head_stride, offset, inv_freq, half,
                                                        positions);
  return cudaGetLastError();
}

cudaError_t launchMlaDecode(const MlaDecodeArgs& args, cudaStream_t stream) {
  if (args.tokens <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(args.tokens * args.heads), static_cast<unsigned>(args.splits));
  const std::size_t smem = (static_cast<std::size_t>(args.latent_dim) + kMlaSplitPositions) * sizeof(float);
  mlaSplitKernel<<<grid, kMlaThreads, smem, stream>>>(args);
  const cudaError_t first = cudaGetLastError();
  if (first != cudaSuccess) return first;
  mlaCombineKernel<<<args.tokens * args.heads, kMlaThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launchGatherLatents(const GatherLatentsArgs& args, cudaStream_t stream) {
  if (args.count <= 0) return cudaSuccess;
  gatherLatentsKernel<<<args.count, kPrefillThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launchMlaPrefillChunk(const MlaPrefillChunkArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.heads <= 0 || args.count <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(args.rows), static_cast<unsigned>(args.heads));
  const std::size_t smem = (static_cast<std::size_t>(args.nope + args.rope) + kMlaPrefillChunk + 1) * sizeof(float);
  mlaPrefillChunkKernel<<<grid, kPrefillThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launchMlaPrefillReset(math::RunningSoftmax* state, float* acc, std::int64_t n, int v, cudaStream_t stream) {
  const std::int64_t total = n * v > n ? n * v : n;
  if (total <= 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((total + kAxpyThreads - 1) / kAxpyThreads);
  mlaPrefillResetKernel<<<blocks, kAxpyThreads, 0, stream>>>(state, acc, n, v);
  return cudaGetLastError();
}

cudaError_t launchMlaPrefillFinish(const math::RunningSoftmax* state, const float* acc, std::int64_t n, int v,
                                   float* out, cudaStream_t stream) {
  if (n * v <= 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((n * v + kAxpyThreads - 1) / kAxpyThreads);
  mlaPrefillFinishKernel<<<blocks, kAxpyThreads, 0, stream>>>(state, acc, n, v, out);
  return cudaGetLastError();
}

cudaError_t launchRouteNoauxTc(const float* logits, const float* bias, const math::RoutingShape& shape, int tokens,
                               std::int32_t* idx, float* weight, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  routeKernel<<<tokens, 32, 0, stream>>>(logits, bias, shape, idx, weight);
  return cudaGetLastError();
}

cudaError_t launchGroupedGemv(const GroupedGemvArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.groups <= 0) return cudaSuccess;
  const dim3 grid((args.rows + kGemvRowsPerBlock - 1) / kGemvRowsPerBlock, args.groups);
  groupedGemvKernel<<<grid, kGemvThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launchMoeGroup(const std::int32_t* chosen, int slots, int experts, std::int32_t* offsets,
                           std::int32_t* slot_of, std::int32_t* failed, std::int32_t* used, cudaStream_t stream) {
  moeGroupKernel<<<1, 1, 0, stream>>>(chosen, slots, experts, offsets, slot_of, failed, used);
  return cudaGetLastError();
}

cudaError_t launchGatherRows(const float* table, std::int64_t first_id, std::int64_t table_rows,
                             const std::int32_t* ids, const std::uint8_t* zero, int rows, int d, float* out,
                             cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return cudaSuccess;
  gatherRowsKernel<<<rows, kAxpyThreads, 0, stream>>>(table, first_id, table_rows, ids, zero, d, out);
  return cudaGetLastError();
}

cudaError_t launchScatterRows(const float* src, const std::int64_t* slots, int rows, int d, float* dst,
                              cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return cudaSuccess;
  scatterRowsKernel<<<rows, kAxpyThreads, 0, stream>>>(src, slots, d, dst);
  return cudaGetLastError();
}

cudaError_t launchScatterRowsBf16(const float* src, const std::int64_t* slots, int rows, int d, std::uint16_t* dst,
                                  cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return cudaSuccess;
  scatterRowsBf16Kernel<<<rows, kAxpyThreads, 0, stream>>>(src, slots, d, dst);
  return cudaGetLastError();
}

cudaError_t launchMoeGather(const float* x, const std::int32_t* slot_of, int tokens, int top_k, int d, float* gx,
                            cudaStream_t stream) {
  if (tokens <= 0 || top_k <= 0 || d <= 0) return cudaSuccess;
  moeGatherKernel<<<tokens * top_k, kAxpyThreads, 0, stream>>>(x, slot_of, top_k, d, gx);
  return cudaGetLastError();
}

cudaError_t launchMoeCombine(const std::int32_t* chosen, const float* weight, const std::int32_t* slot_of, int tokens,
                             int top_k, const float* gout, int d, const float* shared, float* out,
                             cudaStream_t stream) {
  if (tokens <= 0 || d <= 0) return cudaSuccess;
  moeCombineKernel<<<tokens, kAxpyThreads, 0, stream>>>(chosen, weight, slot_of, top_k, gout, d, shared, out);
  return cudaGetLastError();
}

cudaError_t launchFp8Gemv(const Fp8GemvArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.tokens <= 0) return cudaSuccess;
  fp8GemvKernel<<<(args.rows + kGemvRowsPerBlock - 1) / kGemvRowsPerBlock, kGemvThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace pd::gpu::kernels
