// Sampling on the device: penalties, logit_bias, an allowed-token mask, a stable descending sort of each row (CUB) when
// a row filters (top-k / top-p / min-p), then one thread per row draws with math::drawToken, the
// CPU Sampler's arithmetic, keyed by the request's seed and draw counter; then the top logprobs
// a row asks for. Naive on purpose: the draw and the logprob normalizer scan the vocabulary
// serially (docs/gpu.md).
#include <cuda_runtime.h>

#include <cub/device/device_segmented_radix_sort.cuh>

#include "gpu_kernels.h"

namespace pd::gpu::kernels {
namespace {

namespace m = ::pd::gpu::math;

constexpr int kPrepareThreads = 256;

// work = logits with -0 made +0 (the sort would order -0 below +0; the CPU comparator calls them
// equal), ids = 0..vocab-1, offsets = row starts.
__global__ void __launch_bounds__(kPrepareThreads)
    prepareKernel(const float* logits, float* work, std::int32_t* ids, int* offsets, int rows, int vocab) {
  const int row = blockIdx.y;
  const int i = blockIdx.x * kPrepareThreads + threadIdx.x;
  if (i < vocab) {
    const std::int64_t at = static_cast<std::int64_t>(row) * vocab + i;
    work[at] = logits[at] + 0.0F;
    ids[at] = i;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    offsets[row] = row * vocab;
    if (row == rows - 1) offsets[rows] = rows * vocab;
  }
}

// One block per row, a thread per penalized token (distinct within a row: no races).
__global__ void penaltyKernel(float* work, const RowSampling* params, const std::int64_t* begin,
                              const std::int32_t* token, const std::int64_t* count, int vocab) {
  const int row = blockIdx.x;
  const RowSampling p = params[row];
  if (p.presence == 0.0 && p.frequency == 0.0) return;
  for (std::int64_t k = begin[row] + threadIdx.x; k < begin[row + 1]; k += blockDim.x) {
    const std::int32_t tok = token[k];
    if (tok < 0 || tok >= vocab || count[k] <= 0) continue;
    float& v = work[static_cast<std::int64_t>(row) * vocab + tok];
    v = m::penalizedLogit(v, count[k], p.presence, p.frequency);
  }
}

// One block per row, a thread per biased token (distinct within a row: no races), after the
// penalties: the CPU Sampler's order.
__global__ void biasKernel(float* work, const std::int64_t* begin, const std::int32_t* token, const float* value,
                           int vocab) {
  const int row = blockIdx.x;
  for (std::int64_t k = begin[row] + threadIdx.x; k < begin[row + 1]; k += blockDim.x) {
    const std::int32_t tok = token[k];
    if (tok < 0 || tok >= vocab) continue;
    work[static_cast<std::int64_t>(row) * vocab + tok] += value[k];
  }
}

// After the bias: a token the row's allowed-token mask refuses gets -inf (the CPU Sampler's dense
// mask path). One thread per (row, token), as prepareKernel.
__global__ void __launch_bounds__(kPrepareThreads)
    maskKernel(float* work, const RowSampling* params, const std::uint64_t* masks, int vocab) {
  const int row = blockIdx.y;
  const int i = blockIdx.x * kPrepareThreads + threadIdx.x;
  const int mask = params[row].mask;
  if (i >= vocab || mask < 0) return;
  const std::uint64_t* bits = masks + static_cast<std::int64_t>(mask) * m::maskWords(vocab);
  if (!m::tokenAllowed(bits, i)) work[static_cast<std::int64_t>(row) * vocab + i] = -INFINITY;
}

// One thread per row: greedy argmax (lowest id on ties) or the seeded draw; then the logprob of
// the chosen token under the raw logits.
__global__ void drawKernel(SampleArgs a) {
  if (threadIdx.x != 0) return;
  const int row = blockIdx.x;
  const RowSampling p = a.params[row];
  const float* work = a.work + static_cast<std::int64_t>(row) * a.vocab;
  std::int32_t token = 0;
  if (p.greedy != 0) {
    for (int i = 1; i < a.vocab; ++i) {
      if (work[i] > work[token]) token = i;
    }
  } else {
    const std::int32_t* order =
        p.transform.filtered() ? a.sorted_ids + static_cast<std::int64_t>(row) * a.vocab : nullptr;
    token = m::drawToken(work, a.vocab, order, p.transform, m::uniformAt(p.seed, p.draw));
  }
  const float* raw = a.logits + static_cast<std::int64_t>(row) * a.vocab;
  float raw_max = raw[0];
  for (int i = 1; i < a.vocab; ++i) raw_max = raw[i] > raw_max ? raw[i] : raw_max;
  double sum = 0.0;
  for (int i = 0; i < a.vocab; ++i) sum += m::expD(static_cast<double>(raw[i]) - raw_max);
  const double lse = static_cast<double>(raw_max) + log(sum);
  a.lse[row] = lse;
  a.token[row] = token;
  a.logprob[row] = m::rawLogprob(raw[token], lse);
}

constexpr int kTopThreads = 256;

// One block per row: top_n passes; in each, every thread finds its share's best candidate ranked
// after the previous entry (math::bestAfter over a stride of the block), and thread 0 reduces
// the shares with ranksBefore (a total order, so the result is math::topTokens').
__global__ void __launch_bounds__(kTopThreads) topLogprobKernel(SampleArgs a) {
  const int row = blockIdx.x;
  const int n = a.params[row].top_n;
  if (n <= 0) return;  // uniform per block
  const float* raw = a.logits + static_cast<std::int64_t>(row) * a.vocab;
  __shared__ std::int64_t share[kTopThreads];
  __shared__ std::int64_t prev_id;
  __shared__ float prev_v;
  if (threadIdx.x == 0) {
    prev_id = -1;
    prev_v = 0.0F;
  }
  __syncthreads();
  for (int k = 0; k < n; ++k) {
    share[threadIdx.x] = m::bestAfter(raw, threadIdx.x, a.vocab, kTopThreads, prev_v, prev_id);
    __syncthreads();
    if (threadIdx.x == 0) {
      std::int64_t best = -1;
      for (int t = 0; t < kTopThreads; ++t) {
        const std::int64_t c = share[t];
        if (c >= 0 && (best < 0 || m::ranksBefore(raw[c], c, raw[best], best))) best = c;
      }
      const std::int64_t at = static_cast<std::int64_t>(row) * kMaxTopLogprobs + k;
      a.top_ids[at] = static_cast<std::int32_t>(best);
      a.top_logprobs[at] = best >= 0 ? m::rawLogprob(raw[best], a.lse[row]) : 0.0F;
      if (best >= 0) {
        prev_id = best;
        prev_v = raw[best];
      }
    }
    __syncthreads();
  }
}

}  // namespace

cudaError_t sampleSortTempBytes(int rows, int vocab, std::size_t& bytes) {
  bytes = 0;
  return cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
      static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), rows * vocab, rows,
      static_cast<const int*>(nullptr), static_cast<const int*>(nullptr));
}

cudaError_t launchSample(const SampleArgs& a, cudaStream_t stream) {
  if (a.rows <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((a.vocab + kPrepareThreads - 1) / kPrepareThreads),
                  static_cast<unsigned>(a.rows));
  prepareKernel<<<grid, kPrepareThreads, 0, stream>>>(a.logits, a.work, a.ids, a.offsets, a.rows, a.vocab);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  penaltyKernel<<<a.rows, 128, 0, stream>>>(a.work, a.params, a.penalty_begin, a.penalty_token, a.penalty_count,
                                            a.vocab);
  status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  biasKernel<<<a.rows, 128, 0, stream>>>(a.work, a.bias_begin, a.bias_token, a.bias_value, a.vocab);
  status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  if (a.any_masked) {
    maskKernel<<<grid, kPrepareThreads, 0, stream>>>(a.work, a.params, a.masks, a.vocab);
    status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  if (a.any_filtered) {
    // Radix sort is stable: equal logits keep ascending ids, the CPU comparator's tie order.
    std::size_t temp_bytes = a.sort_temp_bytes;
    status = cub::DeviceSegmentedRadixSort::SortPairsDescending(
        a.sort_temp, temp_bytes, a.work, a.sorted, a.ids, a.sorted_ids, a.rows * a.vocab, a.rows, a.offsets,
        a.offsets + 1, 0, static_cast<int>(sizeof(float) * 8), stream);
    if (status != cudaSuccess) return status;
  }
  drawKernel<<<a.rows, 32, 0, stream>>>(a);
  status = cudaGetLastError();
  if (status != cudaSuccess || !a.any_top) return status;
  topLogprobKernel<<<a.rows, kTopThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace pd::gpu::kernels
