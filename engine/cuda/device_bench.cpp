// CUDA build of measureDeviceCeilings (pd/engine/gpu_bench.h): the streaming read, the cuBLAS
// BF16 GEMM and the MLA decode attention kernel, each timed with CUDA events on one stream.
#include <cublas_v2.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>
#include <vector>

#include "device_decode_step.h"
#include "device_ops.h"
#include "device_weights.h"
#include "gpu_kernels.h"
#include "pd/common/log.h"
#include "pd/engine/gpu_bench.h"
#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"

namespace pd::gpu {
namespace {

constexpr int kWarmups = 3;
constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

// A CUDA event that records time (cuda::Event does not): owned, destroyed with the object.
class TimingEvent {
 public:
  static Result<TimingEvent> create() {
    cudaEvent_t event = nullptr;
    PD_CUDA_TRY(cudaEventCreate(&event));
    return TimingEvent(event);
  }
  [[nodiscard]] cudaEvent_t get() const { return event_.get(); }

 private:
  struct Deleter {
    void operator()(cudaEvent_t event) const noexcept {
      const Status status = PD_CUDA_STATUS(cudaEventDestroy(event));
      if (!status.ok()) cuda::detail::logReleaseFailure(status);
    }
  };
  explicit TimingEvent(cudaEvent_t event) : event_(event) {}
  std::unique_ptr<CUevent_st, Deleter> event_;
};

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Runs `enqueue` kWarmups times untimed, then `iterations` times between event pairs; the
// median seconds of one run.
template <class Enqueue>
Result<double> timeMedian(const cuda::Stream& stream, std::int64_t iterations, Enqueue&& enqueue) {
  for (int i = 0; i < kWarmups; ++i) PD_TRY(enqueue());
  std::vector<TimingEvent> events;
  events.reserve(static_cast<std::size_t>(2 * iterations));
  for (std::int64_t i = 0; i < 2 * iterations; ++i) {
    PD_ASSIGN_OR_RETURN(TimingEvent event, TimingEvent::create());
    events.push_back(std::move(event));
  }
  for (std::int64_t i = 0; i < iterations; ++i) {
    PD_CUDA_TRY(cudaEventRecord(events[static_cast<std::size_t>(2 * i)].get(), stream.get()));
    PD_TRY(enqueue());
    PD_CUDA_TRY(cudaEventRecord(events[static_cast<std::size_t>(2 * i + 1)].get(), stream.get()));
  }
  PD_TRY(stream.synchronize());
  std::vector<double> seconds;
  for (std::int64_t i = 0; i < iterations; ++i) {
    float ms = 0.0F;
    PD_CUDA_TRY(cudaEventElapsedTime(&ms, events[static_cast<std::size_t>(2 * i)].get(),
                                     events[static_cast<std::size_t>(2 * i + 1)].get()));
    seconds.push_back(static_cast<double>(ms) * 1e-3);
  }
  return median(std::move(seconds));
}

Result<double> measureReadBandwidth(const DeviceCeilingsConfig& c, const cuda::Stream& stream) {
  const std::uint64_t bytes = static_cast<std::uint64_t>(c.read_mb) * kMiB;
  PD_ASSIGN_OR_RETURN(auto data, cuda::DeviceBuffer<uint4>::create(bytes / sizeof(uint4)));
  PD_ASSIGN_OR_RETURN(auto sink, cuda::DeviceBuffer<unsigned int>::create(kernels::kStreamReadBlocks));
  // Defined contents (the kernel's result is discarded, but reading uninitialized memory is not
  // something to benchmark either).
  PD_CUDA_TRY(cudaMemsetAsync(data.data(), 0x5A, data.bytes(), stream.get()));
  const auto read = [&]() -> Status {
    PD_CUDA_TRY(kernels::launchStreamRead(data.data(), data.size(), sink.data(), stream.get()));
    return okStatus();
  };
  PD_ASSIGN_OR_RETURN(const double seconds, timeMedian(stream, c.iterations, read));
  return static_cast<double>(data.bytes()) / seconds;
}

Result<double> measureGemmFlops(const DeviceCeilingsConfig& c, const cuda::Stream& stream) {
  const std::int64_t n = c.gemm_size;
  const auto count = static_cast<std::size_t>(n * n);
  PD_ASSIGN_OR_RETURN(auto a, cuda::DeviceBuffer<std::uint16_t>::create(count));
  PD_ASSIGN_OR_RETURN(auto b, cuda::DeviceBuffer<std::uint16_t>::create(count));
  PD_ASSIGN_OR_RETURN(auto out, cuda::DeviceBuffer<std::uint16_t>::create(count));
  PD_CUDA_TRY(kernels::launchFillBf16(a.data(), count, 1U, stream.get()));
  PD_CUDA_TRY(kernels::launchFillBf16(b.data(), count, 2U, stream.get()));
  PD_ASSIGN_OR_RETURN(auto blas, cuda::BlasHandle::create(stream));
  const float alpha = 1.0F / static_cast<float>(n);
  const float beta = 0.0F;
  const int dim = static_cast<int>(n);
  const auto gemm = [&]() -> Status {
    PD_CUDA_TRY(cublasGemmEx(blas.get(), CUBLAS_OP_N, CUBLAS_OP_N, dim, dim, dim, &alpha, a.data(), CUDA_R_16BF, dim,
                             b.data(), CUDA_R_16BF, dim, &beta, out.data(), CUDA_R_16BF, dim, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT));
    return okStatus();
  };
  PD_ASSIGN_OR_RETURN(const double seconds, timeMedian(stream, c.iterations, gemm));
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / seconds;
}

// The MLA decode attention kernel alone: `batch` sequences of `context` cached tokens in a BF16
// paged cache (each sequence's blocks contiguous), one query token each.
Result<double> measureAttentionSeconds(const DeviceCeilingsConfig& c, const cuda::Stream& stream) {
  const std::int64_t blocks_per_seq = (c.attention_context + c.attention_block_size - 1) / c.attention_block_size;
  const std::int64_t num_blocks = blocks_per_seq * c.attention_batch;
  const auto cache_count = static_cast<std::size_t>(num_blocks * c.attention_block_size * c.attention_latent_dim);
  const auto q_count = static_cast<std::size_t>(c.attention_batch * c.attention_heads * c.attention_latent_dim);
  PD_ASSIGN_OR_RETURN(auto cache, cuda::DeviceBuffer<std::uint16_t>::create(cache_count));
  PD_ASSIGN_OR_RETURN(auto q_bits, cuda::DeviceBuffer<std::uint16_t>::create(q_count));
  PD_ASSIGN_OR_RETURN(auto q, cuda::DeviceBuffer<float>::create(q_count));
  PD_ASSIGN_OR_RETURN(auto out, cuda::DeviceBuffer<float>::create(q_count));
  PD_CUDA_TRY(kernels::launchFillBf16(cache.data(), cache_count, 3U, stream.get()));
  // F32 queries: zeros would make every score equal; a small pattern keeps the softmax honest.
  std::vector<float> host_q(q_count);
  for (std::size_t i = 0; i < q_count; ++i) host_q[i] = static_cast<float>(static_cast<int>(i % 17) - 8) / 64.0F;
  PD_TRY(q.copyFromHost(host_q, stream));
  std::vector<std::int32_t> tables(static_cast<std::size_t>(num_blocks));
  std::iota(tables.begin(), tables.end(), 0);
  std::vector<std::int64_t> begins(static_cast<std::size_t>(c.attention_batch));
  std::vector<std::int64_t> lens(static_cast<std::size_t>(c.attention_batch), c.attention_context);
  for (std::int64_t s = 0; s < c.attention_batch; ++s) begins[static_cast<std::size_t>(s)] = s * blocks_per_seq;
  PD_ASSIGN_OR_RETURN(auto d_tables, cuda::DeviceBuffer<std::int32_t>::create(tables.size()));
  PD_ASSIGN_OR_RETURN(auto d_begins, cuda::DeviceBuffer<std::int64_t>::create(begins.size()));
  PD_ASSIGN_OR_RETURN(auto d_lens, cuda::DeviceBuffer<std::int64_t>::create(lens.size()));
  PD_TRY(d_tables.copyFromHost(tables, stream));
  PD_TRY(d_begins.copyFromHost(begins, stream));
  PD_TRY(d_lens.copyFromHost(lens, stream));
  PD_ASSIGN_OR_RETURN(auto attention, MlaDecodeAttention::create({.max_tokens = c.attention_batch,
                                                                  .heads = c.attention_heads,
                                                                  .latent_dim = c.attention_latent_dim,
                                                                  .max_context = c.attention_context}));
  const MlaDecodeAttention::Batch batch{.q_cat = q.data(),
                                        .tokens = c.attention_batch,
                                        .cache_layer = cache.data(),
                                        .cache_dtype = DType::BF16,
                                        .block_size = c.attention_block_size,
                                        .num_blocks = num_blocks,
                                        .block_tables = d_tables.data(),
                                        .table_begin = d_begins.data(),
                                        .ctx_len = d_lens.data(),
                                        .max_context_in_batch = c.attention_context,
                                        .scale = 0.0416F,
                                        .out = out.data()};
  PD_ASSIGN_OR_RETURN(const double seconds,
                      timeMedian(stream, c.iterations, [&]() -> Status { return attention.run(batch, stream); }));
  PD_TRY(stream.synchronize());  // host_q and the tables outlive their copies
  return seconds;
}

}  // namespace

Result<DeviceCeilings> measureDeviceCeilings(const DeviceCeilingsConfig& c) {
  PD_TRY(validateDeviceCeilingsConfig(c));
  const std::string name = modelDeviceName(c.device);
  const int count = deviceCount();
  if (count == 0) {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("bench engine --device {}: no CUDA device is visible to this process (check the "
                                 "driver, CUDA_VISIBLE_DEVICES and the container's GPU access)",
                                 name));
  }
  if (c.device.index >= count) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("bench engine --device {}: only {} CUDA device(s) are visible", name, count));
  }
  PD_CUDA_TRY(cudaSetDevice(c.device.index));
  cudaDeviceProp props{};
  PD_CUDA_TRY(cudaGetDeviceProperties(&props, c.device.index));

  // Each measurement frees its buffers before the next; the largest must fit.
  const std::uint64_t read_bytes = static_cast<std::uint64_t>(c.read_mb) * kMiB;
  const std::uint64_t gemm_bytes = 3 * static_cast<std::uint64_t>(c.gemm_size * c.gemm_size) * 2;
  const std::uint64_t attention_bytes =
      static_cast<std::uint64_t>(attentionMinimumBytes(c, 2)) * 2 +
      static_cast<std::uint64_t>(c.attention_batch * c.attention_heads * c.attention_latent_dim) * 4 * 2;
  PD_ASSIGN_OR_RETURN(const DeviceMemoryInfo memory, deviceMemoryInfo());
  const std::uint64_t need = std::max({read_bytes, gemm_bytes, attention_bytes});
  if (need > memory.free) {
    return makeError(ErrorCode::ResourceExhausted,
                     fmt::format("bench engine --device {}: the buffers do not fit: read {:.2f} GB, GEMM {:.2f} GB, "
                                 "attention {:.2f} GB (the largest must fit), but {:.2f} GB are free",
                                 name, static_cast<double>(read_bytes) / 1e9, static_cast<double>(gemm_bytes) / 1e9,
                                 static_cast<double>(attention_bytes) / 1e9, static_cast<double>(memory.free) / 1e9));
  }

  PD_ASSIGN_OR_RETURN(const cuda::Stream stream, cuda::Stream::create());
  DeviceCeilings out;
  out.config = c;
  out.device = fmt::format("{} ({})", name, props.name);
  log::info("bench", "{}: streaming read over {} MiB", out.device, c.read_mb);
  PD_ASSIGN_OR_RETURN(out.read_bandwidth, measureReadBandwidth(c, stream));
  log::info("bench", "{}: BF16 GEMM {}^3 (cuBLAS)", out.device, c.gemm_size);
  PD_ASSIGN_OR_RETURN(out.gemm_flops, measureGemmFlops(c, stream));
  log::info("bench", "{}: MLA decode attention, batch {}, context {}", out.device, c.attention_batch,
            c.attention_context);
  PD_ASSIGN_OR_RETURN(out.attention_seconds, measureAttentionSeconds(c, stream));
  out.attention_bytes = attentionMinimumBytes(c, 2);
  out.attention_hbm_fraction = bandwidthFraction(out.attention_bytes, out.attention_seconds, out.read_bandwidth);
  return out;
}

static_assert(kMaxDeviceDecodeBatch == kMaxDecodeBatch, "the bench's batch limit is the decode step's");

namespace {

// The prompt of sequence 0 (tokens token(0, p)) from position 0 in steps of up to kMaxDecodeBatch
// rows over blocks 0.. of the step's cache (overwriting the decode measurement's), the last row's
// logits copied back: untimed once (twice with graphs), then timed.
template <class TokenAt>
Result<PrefillResult> timePrefill(DeviceDecodeStep& step, const ModelConfig& config, const DeviceDecodeBenchConfig& c,
                                  const TokenAt& token) {
  const std::int64_t n = c.prefill_tokens;
  const std::int64_t block = step.cacheShape().block_size;
  std::vector<std::int32_t> table(static_cast<std::size_t>((n + block - 1) / block));
  std::iota(table.begin(), table.end(), 0);
  std::int64_t absorbed_steps = 0;  // per prompt: the steps CUDA graphs can replay
  const auto prompt = [&]() -> Status {
    absorbed_steps = 0;
    for (std::int64_t begin = 0; begin < n; begin += kMaxDecodeBatch) {
      const std::int64_t rows = std::min(kMaxDecodeBatch, n - begin);
      std::vector<DecodeSequence> seqs;
      seqs.reserve(static_cast<std::size_t>(rows));
      for (std::int64_t p = begin; p < begin + rows; ++p) seqs.push_back({token(0, p), p, table});
      PD_ASSIGN_OR_RETURN(const DecodeStepPlan plan, planDecodeStep(config, step.cacheShape(), seqs));
      const std::vector<std::int64_t> last{rows - 1};
      DeviceDecodeStep::Request request;
      if (begin + rows == n) request.logit_rows = last;
      // The attention path the CUDA engine's Auto takes for this step (the cheaper one).
      request.prefill_attention = preferPrefillAttention(config, plan);
      if (!request.prefill_attention) ++absorbed_steps;
      PD_ASSIGN_OR_RETURN(const DeviceDecodeStep::Output output, step.run(plan, request));
      (void)output;
    }
    return okStatus();
  };
  log::info("bench", "prefill: a prompt of {} tokens", n);
  for (int i = 0; i < (c.cuda_graphs ? 2 : 1); ++i) PD_TRY(prompt());
  const std::int64_t replayed_before = step.graphStats().replayed;
  std::vector<double> seconds;
  for (std::int64_t i = 0; i < c.prefill_repetitions; ++i) {
    const auto start = std::chrono::steady_clock::now();
    PD_TRY(prompt());
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  PrefillResult r;
  r.numerics = c.numerics;
  r.tokens = n;
  r.repetitions = c.prefill_repetitions;
  r.seconds = median(std::move(seconds));
  r.flops = devicePrefillFlops(config, n);
  // Steps on the prefill attention path run eagerly; "replayed" means every other step was.
  r.cuda_graphs =
      absorbed_steps > 0 && step.graphStats().replayed - replayed_before == absorbed_steps * c.prefill_repetitions;
  log::info("bench", "prefill {} tokens: {:.3f} s, {:.2f} TFLOP/s, CUDA graphs {}", n, r.seconds,
            r.seconds > 0 ? r.flops / r.seconds / 1e12 : 0.0, r.cuda_graphs ? "replayed" : "not used");
  return r;
}

}  // namespace

Result<ModelOnDeviceResult> measureModelOnDevice(const std::filesystem::path& model_dir, const ModelDevice& device,
                                                 const DeviceDecodeBenchConfig& requested) {
  PD_TRY(validateDeviceDecodeBenchConfig(requested));
  PD_ASSIGN_OR_RETURN(const Checkpoint checkpoint, Checkpoint::open(model_dir));
  PD_ASSIGN_OR_RETURN(const ModelConfig config, ModelConfig::load(model_dir));
  DeviceDecodeBenchConfig c = requested;
  if (c.prefill_tokens > 0 && config.max_position_embeddings > 0 && c.prefill_tokens > config.max_position_embeddings) {
    log::info("bench", "prefill: {} tokens asked, the model's {} positions measured (max_position_embeddings)",
              c.prefill_tokens, config.max_position_embeddings);
    c.prefill_tokens = config.max_position_embeddings;
  }
  constexpr std::int64_t kBlock = 64;
  const std::int64_t max_batch = *std::max_element(c.batches.begin(), c.batches.end());
  // Decode steps write up to context + 2 warm-up + steps positions; the prefill reuses the blocks.
  const std::int64_t positions = c.context + c.steps + 2;
  const std::int64_t blocks_per_seq = (positions + kBlock - 1) / kBlock;
  const std::int64_t prefill_blocks = (c.prefill_tokens + kBlock - 1) / kBlock;
  const std::int64_t blocks = std::max(blocks_per_seq * max_batch, prefill_blocks);
  DeviceWeights::Options options;
  options.device = device;
  options.serving = DeviceServingShape{.kv_blocks = blocks,
                                       .kv_block_size = kBlock,
                                       .kv_dtype = DType::F32,
                                       .max_batch_tokens = kMaxDecodeBatch,
                                       .max_context = std::max(positions, c.prefill_tokens),
                                       .max_sample_rows = kMaxDecodeBatch};
  ModelOnDeviceResult out;
  out.upload.model = model_dir.string();
  const auto upload_start = std::chrono::steady_clock::now();
  PD_ASSIGN_OR_RETURN(const DeviceWeights weights, DeviceWeights::upload(checkpoint, config, options));
  out.upload.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - upload_start).count();
  out.upload.bytes = static_cast<double>(checkpoint.totalTensorBytes());
  for (const auto& t : weights.tensors()) {
    ++out.upload.tensors;
    if (t.dtype == DType::F8E4M3) ++out.upload.fp8_tensors;
  }
  log::info("bench", "{}: {} tensors, {:.2f} GB uploaded in {:.2f} s", out.upload.model, out.upload.tensors,
            out.upload.bytes / 1e9, out.upload.seconds);

  DeviceDecodeStep::Options step_options;
  step_options.cache = {blocks, kBlock};
  step_options.numerics = c.numerics;
  step_options.cuda_graphs = c.cuda_graphs;
  PD_ASSIGN_OR_RETURN(std::unique_ptr<DeviceDecodeStep> step, DeviceDecodeStep::create(weights, config, step_options));
  // Sequence s owns blocks [s * blocks_per_seq, (s + 1) * blocks_per_seq).
  std::vector<std::vector<std::int32_t>> tables(static_cast<std::size_t>(max_batch));
  for (std::int64_t s = 0; s < max_batch; ++s) {
    auto& t = tables[static_cast<std::size_t>(s)];
    t.resize(static_cast<std::size_t>(blocks_per_seq));
    std::iota(t.begin(), t.end(), static_cast<std::int32_t>(s * blocks_per_seq));
  }
  const std::int64_t vocab = std::max<std::int64_t>(config.vocab_size, 1);
  const auto token = [&](std::int64_t s, std::int64_t pos) {
    return static_cast<std::int32_t>((1 + 7919 * s + 104729 * pos) % vocab);
  };
  const auto batch_at = [&](std::int64_t n, std::int64_t pos) {
    std::vector<DecodeSequence> batch;
    batch.reserve(static_cast<std::size_t>(n));
    for (std::int64_t s = 0; s < n; ++s) batch.push_back({token(s, pos), pos, tables[static_cast<std::size_t>(s)]});
    return batch;
  };
  // Positions 0 .. context-1 of every sequence fill the cache (untimed; the first steps warm up).
  log::info("bench", "decode: filling {} sequences up to {} positions", max_batch, c.context);
  for (std::int64_t pos = 0; pos < c.context; ++pos) {
    PD_ASSIGN_OR_RETURN(const std::vector<float> logits, step->step(batch_at(max_batch, pos)));
    (void)logits;
  }
  // With graphs, each batch's first two steps are its warm-up and its capture (untimed; they write
  // positions context and context + 1, which the timed steps then follow).
  const std::int64_t untimed = c.cuda_graphs ? 2 : 0;
  const std::int64_t mean_context = c.context + untimed + 1 + c.steps / 2;
  for (const std::int64_t n : c.batches) {
    for (std::int64_t i = 0; i < untimed; ++i) {
      PD_ASSIGN_OR_RETURN(const std::vector<float> logits, step->step(batch_at(n, c.context + i)));
      (void)logits;
    }
    const std::int64_t replayed_before = step->graphStats().replayed;
    std::vector<double> seconds;
    std::vector<double> used_sum(static_cast<std::size_t>(config.num_hidden_layers), 0.0);
    for (std::int64_t i = 0; i < c.steps; ++i) {
      const std::vector<DecodeSequence> batch = batch_at(n, c.context + untimed + i);
      const auto start = std::chrono::steady_clock::now();
      PD_ASSIGN_OR_RETURN(const std::vector<float> logits, step->step(batch));
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      (void)logits;
      PD_ASSIGN_OR_RETURN(const std::vector<std::int32_t> used, step->expertsUsedLastRun());
      for (std::size_t l = 0; l < used_sum.size() && l < used.size(); ++l) used_sum[l] += used[l];
    }
    std::vector<std::int32_t> mean_used(used_sum.size());
    double used_total = 0.0;
    std::int64_t moe_layers = 0;
    for (std::size_t l = 0; l < used_sum.size(); ++l) {
      const double mean = used_sum[l] / static_cast<double>(c.steps);
      mean_used[l] = static_cast<std::int32_t>(std::lround(mean));
      if (config.isMoeLayer(static_cast<std::int64_t>(l))) {
        used_total += mean;
        ++moe_layers;
      }
    }
    DecodeStepResult r;
    r.numerics = c.numerics;
    r.batch = n;
    r.context = c.context;
    r.steps = c.steps;
    r.step_seconds = median(std::move(seconds));
    r.cuda_graphs = step->graphStats().replayed - replayed_before == c.steps;
    r.experts_used = moe_layers > 0 ? used_total / static_cast<double>(moe_layers) : 0.0;
    const std::vector<std::int64_t> contexts(static_cast<std::size_t>(n), mean_context);
    r.bytes_per_step = step->stepBytes(contexts, mean_used);
    log::info("bench", "decode batch {}: {:.3f} ms/step, {:.1f} experts per MoE layer, CUDA graphs {}", n,
              r.step_seconds * 1e3, r.experts_used, r.cuda_graphs ? "replayed" : "not used");
    out.decode.push_back(r);
  }
  if (c.prefill_tokens > 0) {
    PD_ASSIGN_OR_RETURN(out.prefill, timePrefill(*step, config, c, token));
  }
  return out;
}

}  // namespace pd::gpu
