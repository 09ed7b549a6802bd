// The CUDA backend of the Engine seam (pd/engine/cuda_engine.h): DeviceWeights + DeviceDecodeStep
// behind model::Engine, with the caller's host latent cache mirrored (see the header).
#include "pd/engine/cuda_engine.h"

#include <fmt/format.h>

#include <cstring>
#include <utility>
#include <vector>

#include "device_decode_step.h"
#include "device_weights.h"
#include "forward_plan.h"
#include "pd/common/dtype.h"
#include "pd/common/kv_format.h"
#include "pd/common/log.h"
#include "pd/engine/cache_residency.h"
#include "pd/engine/device_sampling.h"
#include "pd/engine/model_weights.h"
#include "pd/engine/safetensors.h"
#include "staged_collectives.h"
#include "weight_shard.h"

namespace pd::model {
namespace {

using gpu::DeviceDecodeStep;
using i64 = std::int64_t;
constexpr auto sz(i64 n) {
  return static_cast<std::size_t>(n);
}

// Appends the host cache's latents of `run` (positions of one sequence in contiguous slots) as
// float32 to `out`.
/// Forgets what a CacheResidency holds unless the call it guards reached done().
class ForgetUnlessDone {
 public:
  explicit ForgetUnlessDone(CacheResidency& residency) : residency_(residency) {}
  ~ForgetUnlessDone() {
    if (!done_) residency_.forget();
  }
  ForgetUnlessDone(const ForgetUnlessDone&) = delete;
  ForgetUnlessDone& operator=(const ForgetUnlessDone&) = delete;
  ForgetUnlessDone(ForgetUnlessDone&&) = delete;
  ForgetUnlessDone& operator=(ForgetUnlessDone&&) = delete;
  void done() { done_ = true; }

 private:
  CacheResidency& residency_;
  bool done_ = false;
};

void appendLatents(const LatentCacheView& cache, i64 layer, const gpu::CacheRun& run, std::vector<float>& out) {
  const i64 ld = cache.latent_dim;
  const std::size_t at = out.size();
  out.resize(at + sz(run.count * ld));
  const std::size_t token = cache.tokenBytes();
  const std::byte* src = cache.layers[sz(layer)] + sz(run.slot) * token;
  if (cache.dtype == DType::F32) {
    std::memcpy(out.data() + at, src, sz(run.count * ld) * sizeof(float));
    return;
  }
  for (i64 t = 0; t < run.count; ++t) {  // BF16, or FP8 tiles (kv_format.h) as float32
    decodeKvToken(cache.dtype, src + sz(t) * token, std::span(out).subspan(at + sz(t * ld), sz(ld)));
  }
}

// Mirrors one step's new latents into the caller's host cache and hands them to the sink, after
// the step has run (a collector: no synchronize per layer, so the step can replay a CUDA graph).
// With a BF16 host cache the step rounds the latents to BF16 on the device before its own (BF16)
// cache and attention see them (Request::round_latents_to_bf16); an FP8 device cache encodes them
// as it stores them (kv_format.h tokens). Either way the device attends to what the CPU engine
// would. The collector gets them unrounded, and writing them here rounds or encodes them with the
// same arithmetic (device_math.h, kv_format.h), so host and device caches hold the same values.
class HostMirror final : public DeviceDecodeStep::LatentCollector {
 public:
  HostMirror(const LatentCacheView& cache, std::span<const SequenceChunk> batch, const gpu::ForwardStep& step,
             LatentKvSink* sink)
      : cache_(cache), batch_(batch), step_(step), sink_(sink) {}

  Status onLatents(i64 kv_layer, std::span<const float> latents) override {
    const i64 ld = cache_.latent_dim;
    for (const gpu::ForwardStep::SequenceSpan& sp : step_.sequences) {
      const SequenceChunk& s = batch_[sp.sequence];
      // A device cache (the device KV pool) already holds them: the step wrote them there.
      for (i64 r = 0; r < sp.rows && !cache_.on_device; ++r) {
        writeLatent(cache_, kv_layer, s.block_table, sp.start_pos + r, latents.data() + (sp.first_row + r) * ld);
      }
      if (sink_ != nullptr) {
        sink_->onLayer(kv_layer, sp.sequence, sp.start_pos, latents.subspan(sz(sp.first_row * ld), sz(sp.rows * ld)));
      }
    }
    return okStatus();
  }

 private:
  const LatentCacheView& cache_;
  std::span<const SequenceChunk> batch_;
  const gpu::ForwardStep& step_;
  LatentKvSink* sink_;
};

static_assert(kMaxDeviceTopLogprobs == gpu::kernels::kMaxTopLogprobs, "one limit for the device's top logprobs");

// The device KV pool (Engine::allocateCache): GPU memory laid out as the step's own cache (every
// KV layer's blocks plus the step's padding blocks), which the step then uses as its cache
// directly. The host reaches it only through these methods, each synchronous on the device: they
// run on the legacy default stream, which the step's non-blocking stream does not wait for, so each
// waits for its copies to land (a device-to-device cudaMemcpy, and the DMA of a pageable
// host-to-device one, may still be running when cudaMemcpy returns).
class DeviceCacheMemory final : public CacheMemory {
 public:
  DeviceCacheMemory(cuda::DeviceBuffer<std::uint8_t> memory, LatentCacheView view, int device)
      : memory_(std::move(memory)), view_(std::move(view)), device_(device) {}
  const LatentCacheView& view() const override { return view_; }
  std::size_t bytes() const override { return memory_.bytes(); }
  std::string location() const override { return fmt::format("cuda:{}", device_); }
  Status copyBlock(std::int32_t src, std::int32_t dst) override {
    const std::size_t block = sz(view_.block_size) * view_.tokenBytes();
    PD_CUDA_TRY(cudaSetDevice(device_));
    for (std::byte* layer : view_.layers) {
      PD_CUDA_TRY(cudaMemcpy(layer + sz(dst) * block, layer + sz(src) * block, block, cudaMemcpyDeviceToDevice));
    }
    PD_CUDA_TRY(cudaStreamSynchronize(cudaStreamLegacy));
    return okStatus();
  }
  Status readTokens(std::int64_t layer, std::int64_t first_slot, std::span<std::byte> tokens) const override {
    const std::size_t token = view_.tokenBytes();
    if (!tokenRunInCache(view_, layer, first_slot, tokens.size())) {
      return makeError(ErrorCode::InvalidArgument, "device cache read outside the cache");
    }
    PD_CUDA_TRY(cudaSetDevice(device_));
    PD_CUDA_TRY(cudaMemcpy(tokens.data(), view_.layers[sz(layer)] + sz(first_slot) * token, tokens.size(),
                           cudaMemcpyDeviceToHost));
    return okStatus();
  }
  Status writeTokens(std::int64_t layer, std::int64_t first_slot, std::span<const std::byte> tokens) override {
    const std::size_t token = view_.tokenBytes();
    if (!tokenRunInCache(view_, layer, first_slot, tokens.size())) {
      return makeError(ErrorCode::InvalidArgument, "device cache write outside the cache");
    }
    PD_CUDA_TRY(cudaSetDevice(device_));
    PD_CUDA_TRY(cudaMemcpy(view_.layers[sz(layer)] + sz(first_slot) * token, tokens.data(), tokens.size(),
                           cudaMemcpyHostToDevice));
    PD_CUDA_TRY(cudaStreamSynchronize(cudaStreamLegacy));
    return okStatus();
  }

 private:
  cuda::DeviceBuffer<std::uint8_t> memory_;
  LatentCacheView view_;
  int device_;
};

class CudaEngine final : public Engine, public SamplingEngine {
 public:
  CudaEngine(std::unique_ptr<comm::DeviceCollectives> staged, std::unique_ptr<const ModelConfig> config,
             std::unique_ptr<gpu::DeviceWeights> weights, std::unique_ptr<DeviceDecodeStep> step,
             const CudaEngineOptions& options, DType weight_dtype)
      : staged_(std::move(staged)),
        config_(std::move(config)),
        weights_(std::move(weights)),
        step_(std::move(step)),
        options_(options),
        weight_dtype_(weight_dtype) {}

  ~CudaEngine() override {
    step_.reset();  // before the weights it reads (members would do the same; said for the reader)
  }
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  [[nodiscard]] const ModelConfig& config() const override { return *config_; }

  [[nodiscard]] EngineCapabilities capabilities() const override {
    EngineCapabilities c;
    c.backend =
        fmt::format("cuda/{} ({})", gpu::numericsName(options_.numerics), gpu::modelDeviceName(options_.device));
    if (options_.tp != nullptr && options_.tp->size() > 1) {
      c.backend += fmt::format(", tensor-parallel rank {} of {}", options_.tp->rank(), options_.tp->size());
    }
    c.threads = 1;
    c.mtp = step_->hasMtp();
    c.weight_dtype = weight_dtype_;
    return c;
  }

  Result<ForwardOutput> forward(std::span<const SequenceChunk> batch, const LatentCacheView& cache,
                                const ForwardOptions& options) override {
    PD_ASSIGN_OR_RETURN(SampledForward out, run(batch, cache, options, false, {}));
    return std::move(out.output);
  }

  Result<SampledForward> forwardSampled(std::span<const SequenceChunk> batch, const LatentCacheView& cache,
                                        const ForwardOptions& options, std::span<const RowSample> rows) override {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (rows[i].params == nullptr || !deviceSamplable(*rows[i].params)) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("sampled forward: row {} has no sampling parameters the device can sample", i));
      }
    }
    if (rows.empty()) return makeError(ErrorCode::InvalidArgument, "sampled forward: no rows to sample");
    return run(batch, cache, options, false, rows);
  }

  Result<ForwardOutput> forwardMtp(std::span<const SequenceChunk> batch, const LatentCacheView& cache,
                                   const ForwardOptions& options) override {
    if (!step_->hasMtp()) return makeError(ErrorCode::Unsupported, "the checkpoint has no MTP layer");
    PD_ASSIGN_OR_RETURN(SampledForward out, run(batch, cache, options, true, {}));
    return std::move(out.output);
  }

  // GPU memory the step uses as its cache directly: the device KV pool (docs/gpu.md). One at a
  // time: the engine forgets an earlier one (its owner must no longer pass it).
  Result<std::unique_ptr<CacheMemory>> allocateCache(std::int64_t num_blocks, std::int64_t block_size,
                                                     DType dtype) override {
    const gpu::DecodeCacheShape shape{num_blocks, block_size, dtype};
    PD_TRY(gpu::checkCacheShape(shape));
    const int device = options_.device.index;
    PD_CUDA_TRY(cudaSetDevice(device));
    const std::uint64_t bytes = step_->cacheBytesFor(shape);
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    PD_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (bytes > free_bytes) {
      return makeError(ErrorCode::ResourceExhausted,
                       fmt::format("cuda:{}: a KV pool of {} blocks x {} tokens ({:.2f} GB) does not fit in the {:.2f} "
                                   "GB free",
                                   device, num_blocks, block_size, static_cast<double>(bytes) / 1e9,
                                   static_cast<double>(free_bytes) / 1e9));
    }
    PD_ASSIGN_OR_RETURN(cuda::DeviceBuffer<std::uint8_t> memory, cuda::DeviceBuffer<std::uint8_t>::create(sz(bytes)));
    PD_CUDA_TRY(cudaMemset(memory.data(), 0, memory.bytes()));
    PD_CUDA_TRY(cudaStreamSynchronize(cudaStreamLegacy));  // before any step writes into the pool
    LatentCacheView view;
    view.dtype = dtype;
    view.latent_dim = config_->latentDim();
    view.block_size = block_size;
    view.num_blocks = num_blocks;
    view.on_device = true;
    view.device = device;
    const std::uint64_t layer_bytes = bytes / static_cast<std::uint64_t>(step_->cacheLayers());
    for (i64 l = 0; l < step_->cacheLayers(); ++l) {
      view.layers.push_back(reinterpret_cast<std::byte*>(memory.data()) + sz(l) * layer_bytes);
    }
    device_cache_ = view.layers.front();
    device_cache_shape_ = shape;
    main_residency_.forget();
    mtp_residency_.forget();
    PD_TRY(step_->useExternalCache(shape, device_cache_));
    log::info("cuda", "cuda:{}: KV cache of {} blocks x {} tokens ({}, {:.2f} GB) in GPU memory", device, num_blocks,
              block_size, kvDTypeName(dtype), static_cast<double>(bytes) / 1e9);
    return std::unique_ptr<CacheMemory>(new DeviceCacheMemory(std::move(memory), std::move(view), device));
  }

 private:
  // `rows` empty: logits come back; otherwise one sampling request per logits row.
  Result<SampledForward> run(std::span<const SequenceChunk> batch, const LatentCacheView& cache,
                             const ForwardOptions& options, bool mtp, std::span<const RowSample> rows) {
    const ModelConfig& c = *config_;
    const i64 kv_layer_last = mtp ? c.num_hidden_layers : c.num_hidden_layers - 1;
    PD_ASSIGN_OR_RETURN(gpu::ForwardPlan plan, gpu::planForward(c, cache, batch, kv_layer_last, mtp, options.logits,
                                                                options.hidden, options_.max_step_rows));
    if (options.trace != nullptr) {
      return makeError(ErrorCode::Unsupported, "the CUDA engine does not fill a ForwardTrace (use the CPU engine)");
    }
    if (!rows.empty() && static_cast<i64>(rows.size()) != plan.logit_rows) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("sampled forward: {} sampling requests for {} logits "
                                                               "rows",
                                                               rows.size(), plan.logit_rows));
    }
    std::vector<gpu::DeviceSampler::Row> sample_rows;
    std::vector<std::vector<std::pair<std::int32_t, float>>> biases(rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const RowSample& r = rows[i];
      const SamplingParams& p = *r.params;
      for (const LogitBias& b : p.logit_bias) biases[i].emplace_back(b.token, b.bias);
      gpu::DeviceSampler::Row row{p.temperature,       p.top_k, p.top_p, p.min_p, p.presence_penalty,
                                  p.frequency_penalty, p.seed,  r.draw,  r.counts};
      row.logit_bias = biases[i];
      row.top_logprobs = p.top_logprobs;
      row.allowed = r.allowed;  // DeviceSampler::sample checks its size and that it allows a token
      sample_rows.push_back(row);
    }
    CacheResidency& residency = mtp ? mtp_residency_ : main_residency_;
    ForgetUnlessDone guard(residency);
    if (cache.on_device) {
      // The device KV pool this engine allocated: the step's cache itself, nothing to copy.
      const gpu::DecodeCacheShape shape{cache.num_blocks, cache.block_size, cache.dtype};
      if (cache.layers.empty() || cache.layers.front() != device_cache_ || !(shape == device_cache_shape_)) {
        return makeError(ErrorCode::InvalidArgument, "a GPU cache this engine did not allocate");
      }
      PD_TRY(step_->useExternalCache(shape, device_cache_));
    } else {
      // A host cache, mirrored: the device cache takes its dtype (BF16 halves its memory and the
      // attention's reads, FP8 tokens (kv_format.h) about quarter them; an F32 host cache, the
      // golden parity mode, keeps F32). Leaving the device pool for it reallocates the step's own
      // cache, so nothing of it is held yet.
      if (device_cache_ != nullptr && step_->usesExternalCache(device_cache_)) {
        main_residency_.forget();
        mtp_residency_.forget();
      }
      PD_TRY(step_->setCacheShape({cache.num_blocks, cache.block_size, cache.dtype}));
      // Only the positions the device cache does not hold yet cross over (CacheResidency); a call
      // that fails past this point leaves the device cache unknown, so it is forgotten.
      PD_TRY(uploadRanges(residency.prepare(batch, cache), cache, mtp ? c.num_hidden_layers : 0, kv_layer_last + 1));
    }
    SampledForward result;
    ForwardOutput& out = result.output;
    if (rows.empty()) out.logits.reserve(sz(plan.logit_rows * c.vocab_size));
    out.hidden.reserve(sz(plan.hidden_rows * c.hidden_size));
    std::size_t sampled_at = 0;  // the first sampling request of the step
    std::vector<float> prev_hidden;
    std::vector<std::uint8_t> zero_embedding;
    for (const gpu::ForwardStep& step : plan.steps) {
      HostMirror mirror(cache, batch, step, options.sink);
      DeviceDecodeStep::Request request;
      request.mtp = mtp;
      request.logit_rows = step.logit_rows;
      request.hidden_rows = step.hidden_rows;
      request.collector = &mirror;
      request.round_latents_to_bf16 = cache.dtype == DType::BF16;
      // Auto: per step, the path that costs fewer operations (gpu::preferPrefillAttention).
      request.prefill_attention =
          options.attention == AttentionPath::Prefill ||
          (options.attention == AttentionPath::Auto && gpu::preferPrefillAttention(c, step.plan));
      if (!sample_rows.empty()) {
        request.sample_rows = std::span(sample_rows).subspan(sampled_at, step.logit_rows.size());
        sampled_at += step.logit_rows.size();
      }
      if (mtp) {
        const i64 d = c.hidden_size;
        prev_hidden.assign(sz(step.plan.tokens * d), 0.0F);
        zero_embedding.assign(sz(step.plan.tokens), 0);
        for (const gpu::ForwardStep::SequenceSpan& sp : step.sequences) {
          const SequenceChunk& s = batch[sp.sequence];
          const i64 first_index = sp.start_pos - s.start_pos;  // of the sequence's chunk
          std::memcpy(prev_hidden.data() + sp.first_row * d, s.prev_hidden.data() + first_index * d,
                      sz(sp.rows * d) * sizeof(float));
        }
        for (i64 r = 0; r < step.plan.tokens; ++r) {
          zero_embedding[sz(r)] = options.mtp_zero_position0_embedding && step.plan.positions[sz(r)] == 0 ? 1 : 0;
        }
        request.prev_hidden = prev_hidden;
        request.zero_embedding = zero_embedding;
      }
      PD_ASSIGN_OR_RETURN(DeviceDecodeStep::Output o, step_->run(step.plan, request));
      out.logits.insert(out.logits.end(), o.logits.begin(), o.logits.end());
      out.hidden.insert(out.hidden.end(), o.hidden.begin(), o.hidden.end());
      for (const gpu::DeviceSampler::Sampled& s : o.sampled) {
        SampledToken t;
        t.token = s.token;
        t.logprob = s.logprob;
        for (const auto& [token, logprob] : s.top) t.top.push_back({token, logprob});
        result.sampled.push_back(std::move(t));
      }
    }
    guard.done();
    return result;
  }

  // The positions `ranges` name, KV layers [first, end), host cache -> device cache.
  Status uploadRanges(const std::vector<CacheResidency::Range>& ranges, const LatentCacheView& cache, i64 first,
                      i64 end) {
    std::vector<std::int64_t> slots;
    std::vector<std::int64_t> counts;
    for (const CacheResidency::Range& r : ranges) {
      slots.push_back(r.block * cache.block_size + r.first);
      counts.push_back(r.count);
    }
    if (slots.empty()) return okStatus();
    if (cache.dtype == DType::F8E4M3) {  // tokens cross as the host cache stores them
      const std::size_t token = cache.tokenBytes();
      std::vector<std::byte> tokens;
      for (i64 layer = first; layer < end; ++layer) {
        tokens.clear();
        for (std::size_t i = 0; i < slots.size(); ++i) {
          const std::byte* src = cache.layers[sz(layer)] + sz(slots[i]) * token;
          tokens.insert(tokens.end(), src, src + sz(counts[i]) * token);
        }
        PD_TRY(step_->writeCacheTokens(layer, slots, counts, tokens));
      }
      return okStatus();
    }
    std::vector<float> values;
    for (i64 layer = first; layer < end; ++layer) {
      values.clear();
      for (std::size_t i = 0; i < slots.size(); ++i) appendLatents(cache, layer, {0, slots[i], counts[i]}, values);
      PD_TRY(step_->writeCache(layer, slots, counts, values));
    }
    return okStatus();
  }

  // Declared in acquisition order: the step refers to the weights and the config.
  std::unique_ptr<comm::DeviceCollectives> staged_;  // staged collectives the step uses, or null
  std::unique_ptr<const ModelConfig> config_;
  std::unique_ptr<gpu::DeviceWeights> weights_;
  std::unique_ptr<DeviceDecodeStep> step_;
  CudaEngineOptions options_;
  DType weight_dtype_;
  CacheResidency main_residency_;      // what the device cache holds of the main layers
  CacheResidency mtp_residency_;       // and of the MTP layer
  std::byte* device_cache_ = nullptr;  // the device KV pool allocateCache made, if any (owned by its CacheMemory)
  gpu::DecodeCacheShape device_cache_shape_;
};

}  // namespace

Result<std::unique_ptr<Engine>> createCudaEngine(const std::filesystem::path& model_dir,
                                                 const CudaEngineOptions& options) {
  PD_TRY(checkCudaEngineOptions(options));
  if (options.max_step_rows <= 0 || options.max_step_rows > gpu::kMaxDecodeBatch || options.kv_blocks < 0 ||
      options.kv_block_size <= 0) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("cuda engine: max_step_rows {} (1..{}), kv_blocks {}, kv_block_size {}", options.max_step_rows,
                    gpu::kMaxDecodeBatch, options.kv_blocks, options.kv_block_size));
  }
  PD_TRY(gpu::checkModelDevice(options.device));
  PD_ASSIGN_OR_RETURN(ModelConfig loaded, ModelConfig::load(model_dir));
  auto config = std::make_unique<const ModelConfig>(std::move(loaded));
  const ModelConfig& c = *config;
  PD_TRY(gpu::checkDecodeModel(c));
  const bool sharded = options.tp != nullptr && options.tp->size() > 1;
  const i64 max_context = c.max_position_embeddings > 0 ? c.max_position_embeddings : 4096;
  gpu::DeviceWeights::Options upload;
  upload.device = options.device;
  upload.serving.kv_block_size = options.kv_block_size;
  upload.serving.kv_blocks =
      options.kv_blocks > 0 ? options.kv_blocks : (max_context + options.kv_block_size - 1) / options.kv_block_size;
  upload.serving.kv_dtype = DType::F32;  // the host cache's dtype is known at the first call: the larger
  upload.serving.max_batch_tokens = options.max_step_rows;
  upload.serving.max_context = max_context;
  upload.serving.max_sample_rows = options.max_step_rows;
  std::unique_ptr<gpu::DeviceWeights> weights;
  std::unique_ptr<comm::DeviceCollectives> staged;
  DeviceDecodeStep::Options step_options;
  if (sharded) {
    // Only this rank's shard reaches the device; the host slices are released after the upload.
    const TpShard shard{options.tp->rank(), options.tp->size()};
    PD_ASSIGN_OR_RETURN(const std::unique_ptr<ModelWeights> host, ModelWeights::load(model_dir, shard));
    PD_ASSIGN_OR_RETURN(const std::vector<gpu::HostTensor> tensors, gpu::shardTensors(*host));
    PD_ASSIGN_OR_RETURN(gpu::DeviceWeights uploaded, gpu::DeviceWeights::upload(tensors, c, upload));
    weights = std::make_unique<gpu::DeviceWeights>(std::move(uploaded));
    step_options.tp = options.tp->deviceCollectives();
    if (step_options.tp == nullptr) {
      staged = gpu::stageDeviceCollectives(*options.tp);
      step_options.tp = staged.get();
    }
    log::info("engine", "cuda engine: tensor-parallel rank {} of {} ({} heads of {}), collectives: {}", shard.rank,
              shard.size, c.num_attention_heads / shard.size, c.num_attention_heads, step_options.tp->kind());
  } else {
    PD_ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::open(model_dir));
    PD_ASSIGN_OR_RETURN(gpu::DeviceWeights uploaded, gpu::DeviceWeights::upload(checkpoint, c, upload));
    weights = std::make_unique<gpu::DeviceWeights>(std::move(uploaded));
  }
  step_options.numerics = options.numerics;
  step_options.cuda_graphs = options.cuda_graphs;
  // One block for now: the first call sizes the device cache like the caller's host cache.
  step_options.cache = {1, options.kv_block_size};
  PD_ASSIGN_OR_RETURN(std::unique_ptr<DeviceDecodeStep> step, DeviceDecodeStep::create(*weights, c, step_options));
  DType weight_dtype = DType::BF16;
  if (const gpu::DeviceWeights::Tensor* t = weights->find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")) {
    weight_dtype = t->dtype;
  }
  log::info("engine", "cuda engine on {}: {} layers{}, weights {:.2f} GB on the device, fp32 mode",
            gpu::modelDeviceName(options.device), c.num_hidden_layers, step->hasMtp() ? " + MTP" : "",
            static_cast<double>(weights->deviceBytes()) / 1e9);
  return std::unique_ptr<Engine>(
      new CudaEngine(std::move(staged), std::move(config), std::move(weights), std::move(step), options, weight_dtype));
}

}  // namespace pd::model
