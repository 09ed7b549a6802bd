#pragma once
/// The analytical capacity model behind `pdserve plan` (docs/planner.md has the equations): what a
/// DeepSeek-V3-class model served with disaggregated prefill and decode pools does on a given
/// hardware and parallel layout, before anyone buys the hardware.
///
/// Inputs are plain structs (ModelShape, HardwareProfile, ParallelLayout, Workload, Slo); outputs
/// are time breakdowns in seconds, bytes and rates. Units inside the library are SI: bytes,
/// seconds, bytes/s, FLOP/s. Flags in friendlier units are converted by the command.
///
/// Thread rules: pure functions over values; no I/O, no shared state (safe from any thread).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/model_config.h"

namespace pd::plan {

/// What one decode step of the model reads and computes, derived from the tensor layout of a
/// config (the same layout `pdserve inspect` counts). "Fixed" means read by every step whatever
/// the batch: everything except the routed experts and the embedding table (one row per token).
struct ModelShape {
  std::string name;
  std::int64_t layers = 0;      ///< main layers
  std::int64_t moe_layers = 0;  ///< main layers whose FFN is MoE
  std::int64_t mtp_layers = 0;  ///< MTP modules (num_nextn_predict_layers)
  std::int64_t mtp_moe_layers = 0;
  std::int64_t hidden = 0;
  std::int64_t vocab = 0;
  std::int64_t heads = 0;
  std::int64_t kv_lora_rank = 0;
  std::int64_t qk_nope_head_dim = 0;
  std::int64_t qk_rope_head_dim = 0;
  std::int64_t v_head_dim = 0;
  std::int64_t n_routed_experts = 0;
  std::int64_t experts_per_token = 0;
  bool fp8_weights = false;
  double kv_dtype_bytes = 2.0;  ///< latent KV cache element size (BF16 2, FP8 1)

  double main_fixed_bytes = 0;   ///< main layers' non-routed weights + final norm + lm_head (+ 1 embedding row)
  double main_fixed_params = 0;  ///< matrix-product parameters of the same (FLOPs/token = 2x)
  double lm_head_bytes = 0;
  double lm_head_params = 0;
  double expert_bytes = 0;     ///< one routed expert: gate, up, down (+ FP8 scales)
  double expert_params = 0;    ///< one routed expert's parameters
  double mtp_fixed_bytes = 0;  ///< per MTP pass: MTP block non-routed weights, eh_proj, norms, shared_head
  double mtp_fixed_params = 0;
  double total_weight_bytes = 0;  ///< everything stored (memory footprint), MTP included
  double total_params = 0;

  /// Parameters one token activates in the main model (DeepSeek-V3: about 37 B).
  [[nodiscard]] double activatedParams() const;
  /// Bytes one batch-1 step reads: fixed bytes + top-k experts in every MoE layer.
  [[nodiscard]] double activatedBytes() const;
  /// Latent KV per token of the main layers: (kv_lora_rank + qk_rope_head_dim) x layers x dtype.
  [[nodiscard]] double kvBytesPerTokenMain() const;
  /// The same over the main and the MTP layers (what the decode pool stores when MTP is on).
  [[nodiscard]] double kvBytesPerTokenWithMtp() const;
};

/// Shape from a config (FP8 when config.quantization is set). InvalidArgument when the config
/// does not validate or has no MoE layers' experts to count.
Result<ModelShape> shapeFromConfig(const ModelConfig& config, std::string name);

/// Planner presets: "deepseek-v3" (the real 671 B / 37 B-activated config, FP8 weights as
/// released), "deepseek-v3-bf16", and every model_factory preset (tiny, small, bench, default,
/// deepseek-v3-layers=N; BF16). InvalidArgument naming the choices when unknown.
Result<ModelShape> presetShape(std::string_view name);
[[nodiscard]] std::vector<std::string> modelPresetNames();

/// One accelerator type and the network around it, plus the model's efficiency constants.
struct HardwareProfile {
  std::string name;
  double hbm_bandwidth = 0;  ///< bytes/s per GPU (datasheet)
  double hbm_capacity = 0;   ///< bytes per GPU
  double bf16_flops = 0;     ///< dense FLOP/s per GPU
  double fp8_flops = 0;      ///< dense FLOP/s per GPU
  std::int64_t gpus_per_node = 8;
  double nvlink_bandwidth = 0;  ///< bytes/s per GPU, one direction (PCIe for cards without NVLink)
  double nvlink_latency = 0;    ///< seconds per small-message collective inside a node
  double net_bandwidth = 0;     ///< bytes/s per GPU between nodes (its NIC)
  double net_latency = 0;       ///< seconds, one-way small-message latency between nodes

  /// Fraction of hbm_bandwidth that weight and KV reads reach (1 = the datasheet ceiling).
  double memory_efficiency = 1.0;
  /// Fraction of the dense FLOP/s that matrix products and attention reach.
  double compute_efficiency = 0.6;
  /// Fitted constant 1: seconds every cross-node collective costs besides network latency
  /// (collective launch, synchronisation, host-side progress of the network stack).
  double net_collective_overhead = 0;
  /// Fitted constant 2: network latencies one cross-node collective waits for.
  double net_latency_hops = 0;
};

/// The two constants fitted to the published TP16-over-two-H20-nodes experiment (docs/planner.md).
inline constexpr double kFittedNetCollectiveOverhead = 291e-6;  // seconds
inline constexpr double kFittedNetLatencyHops = 0.619;

/// Built-in profiles: h200, h800, h100, h20, rtx4090. InvalidArgument naming the choices.
Result<HardwareProfile> builtinHardware(std::string_view name);
[[nodiscard]] std::vector<std::string> hardwareNames();

/// One pool's parallel layout. A replica (instance) spans `tp` GPUs over `nodes` nodes;
/// attention and dense layers are tensor-parallel over tp; routed experts are spread over `ep`
/// ranks and each split tp/ep ways; the pool has `dp` independent replicas.
struct ParallelLayout {
  std::int64_t tp = 1;
  std::int64_t ep = 1;
  std::int64_t dp = 1;
  std::int64_t nodes = 0;  ///< 0: ceil(tp / gpus_per_node)

  [[nodiscard]] std::int64_t gpus() const { return tp * dp; }
};

struct Workload {
  std::int64_t input_len = 1024;
  std::int64_t output_len = 256;
  std::int64_t concurrency = 1;  ///< users each with one request in flight (closed loop)
  double request_rate = 0;       ///< requests/s of an open (Poisson) loop; 0: closed loop of `concurrency`
  std::int64_t mtp_k = 0;        ///< draft tokens per step (0: MTP off)
  double mtp_acceptance = 0.85;  ///< probability each draft is accepted given the previous one was
};

struct Slo {
  double ttft = 2.0;  ///< seconds
  double tpot = 0.1;  ///< seconds per output token
};

struct PlanInput {
  ModelShape model;
  HardwareProfile hardware;
  ParallelLayout prefill;
  ParallelLayout decode;
  Workload workload;
  Slo slo;
  /// KV streams layer by layer while prefill computes (pdserve does); false: sent after prefill.
  bool kv_streaming = true;
};

/// Decode step time per replica, in seconds. total = max(weight_reads + kv_reads, compute)
/// + collectives + mtp_draft (memory and compute overlap; TP collectives and drafts do not).
struct StepBreakdown {
  double total = 0;
  double weight_reads = 0;
  double kv_reads = 0;
  double compute = 0;
  double collectives = 0;
  double mtp_draft = 0;
  bool compute_bound = false;
  double tokens_per_step = 1;         ///< expected tokens each sequence gains per step
  double experts_read_per_layer = 0;  ///< expected distinct routed experts read per MoE layer (busiest GPU)
  std::int64_t collectives_per_step = 0;
  double weight_bytes_per_gpu = 0;  ///< read per step, main model
  double kv_bytes_per_gpu = 0;      ///< read per step, main model
};

struct DecodePrediction {
  StepBreakdown step;
  double batch_per_replica = 0;
  double tokens_per_s_per_user = 0;
  double tokens_per_s_total = 0;
  double tpot = 0;  ///< seconds per output token = 1 / tokens_per_s_per_user
};

/// TTFT in seconds: queueing + prefill_compute + kv_transfer (the part not hidden by streaming).
struct TtftBreakdown {
  double total = 0;
  double queueing = 0;
  double prefill_compute = 0;
  double kv_transfer = 0;
  double arrival_rate = 0;         ///< requests/s into the prefill pool
  double prefill_utilization = 0;  ///< per prefill replica
  bool saturated = false;          ///< open loop with utilization >= 1: queueing grows without bound
};

struct MemoryFit {
  double weight_bytes_per_gpu = 0;
  double kv_bytes_per_gpu = 0;      ///< the replica's requests at full length (latent KV on every TP rank)
  double usable_bytes_per_gpu = 0;  ///< kHbmUsableFraction x capacity
  std::int64_t max_batch_per_replica = 0;
  bool fits = false;
};
inline constexpr double kHbmUsableFraction = 0.9;

/// The cheapest pools (in GPUs) meeting both SLOs for the workload's concurrency (or rate).
struct PoolRatio {
  bool feasible = false;
  std::string reason;  ///< why not, when infeasible
  std::int64_t prefill_replicas = 0;
  std::int64_t decode_replicas = 0;
  std::int64_t prefill_gpus = 0;
  std::int64_t decode_gpus = 0;
  double ratio = 0;  ///< prefill_gpus / decode_gpus
  double ttft = 0;
  double tpot = 0;
};

struct Prediction {
  DecodePrediction decode;
  TtftBreakdown ttft;
  MemoryFit memory;
  PoolRatio pools;
  double single_stream_ceiling_tokens_per_s = 0;  ///< one GPU's bandwidth / activated bytes
  double mtp_tokens_per_step = 1;
  double kv_bytes_per_token = 0;             ///< main layers (+ MTP layers when MTP is on)
  double kv_bytes_per_request = 0;           ///< (input_len + output_len) x kv_bytes_per_token
  double kv_transfer_bytes_per_request = 0;  ///< input_len x kv_bytes_per_token, prefill -> decode
};

/// InvalidArgument naming the input: non-positive sizes, tp not a multiple of nodes or of ep,
/// more GPUs per node than the hardware has, MTP asked of a model without an MTP layer, ...
Status validate(const PlanInput& input);

/// Every prediction for `input` (validated first).
Result<Prediction> predict(const PlanInput& input);

/// Expected distinct experts that `tokens` tokens select among n experts when each picks k,
/// assuming independent uniform routing: n (1 - (1 - k/n)^tokens).
[[nodiscard]] double expectedDistinctExperts(double n, double k, double tokens);

/// 1 + sum_{i=1..k} a^i: tokens a sequence gains per step with k drafts accepted in a chain.
[[nodiscard]] double mtpTokensPerStep(std::int64_t k, double acceptance);

/// Decode of one replica holding `batch` sequences with `context` cached tokens each.
/// Precondition: validate(input) passed.
[[nodiscard]] StepBreakdown decodeStep(const PlanInput& input, double batch, double context);

/// Decode at `concurrency` users spread over `decode_replicas` replicas (average context:
/// input_len + output_len / 2).
[[nodiscard]] DecodePrediction predictDecode(const PlanInput& input, std::int64_t concurrency,
                                             std::int64_t decode_replicas);

/// Prefill of one prompt on one prefill replica, seconds (no queueing).
[[nodiscard]] double prefillTime(const PlanInput& input, std::int64_t prompt_len);

/// TTFT with `prefill_replicas` replicas, decode at `tpot` seconds per token.
[[nodiscard]] TtftBreakdown predictTtft(const PlanInput& input, std::int64_t prefill_replicas, double tpot);

// ---- Calibration ----

/// One measured decode level: total output tokens/s at a concurrency.
struct CalibrationPoint {
  std::int64_t concurrency = 1;
  double tokens_per_s_total = 0;
  double context = -1;      ///< cached tokens per sequence; < 0: input_len + output_len / 2
  double net_latency = -1;  ///< seconds; < 0: the hardware profile's
};

struct CalibrationResult {
  HardwareProfile hardware;                          ///< the input profile with the fitted constants
  std::string fitted;                                ///< which constants were fitted, in words
  std::vector<double> predicted_tokens_per_s_total;  ///< per point, with the fitted constants
  double rms_relative_error = 0;
};

/// Fits to measured points: with two or more distinct network latencies (and a replica spanning
/// nodes), the two network constants by least squares on step time vs latency; otherwise
/// memory_efficiency and compute_efficiency by minimising squared log error. InvalidArgument
/// for no points, non-positive measurements or an invalid input.
Result<CalibrationResult> calibrate(const PlanInput& input, const std::vector<CalibrationPoint>& points);

}  // namespace pd::plan
