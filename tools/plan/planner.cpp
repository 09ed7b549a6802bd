// The capacity model of docs/planner.md: decode step time, TTFT, KV sizes, memory fit, the
// cheapest prefill:decode pools under SLOs, and calibration of the efficiency constants.
// Pure functions over values (callable from any thread); every quantity in SI units.
#include "planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <set>

#include "model_tools/checkpoint_summary.h"
#include "pd/common/dtype.h"
#include "pd/engine/model_factory.h"

namespace pd::plan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double asDouble(std::int64_t v) {
  return static_cast<double>(v);
}

std::int64_t replicaNodes(const ParallelLayout& layout, const HardwareProfile& hw) {
  if (layout.nodes > 0) return layout.nodes;
  return std::max<std::int64_t>(1, (layout.tp + hw.gpus_per_node - 1) / hw.gpus_per_node);
}

/// One collective among a replica's tp GPUs carrying `bytes` per GPU: an allreduce (hierarchical
/// across nodes: reduce-scatter in the node, allreduce of each GPU's slice across nodes,
/// all-gather in the node) or a one-way exchange (all-to-all, all-gather).
double collectiveTime(const HardwareProfile& hw, std::int64_t tp, std::int64_t nodes, double bytes, bool allreduce) {
  if (tp <= 1) return 0.0;
  const double per_node = asDouble(tp) / asDouble(nodes);
  double t = 0.0;
  if (per_node > 1.0) {
    const double f = allreduce ? 2.0 * (per_node - 1.0) / per_node : (per_node - 1.0) / per_node;
    t += hw.nvlink_latency + f * bytes / hw.nvlink_bandwidth;
  }
  if (nodes > 1) {
    const double n = asDouble(nodes);
    const double slice = allreduce ? bytes / per_node : bytes;
    const double f = allreduce ? 2.0 * (n - 1.0) / n : (n - 1.0) / n;
    t += hw.net_collective_overhead + hw.net_latency_hops * hw.net_latency + f * slice / hw.net_bandwidth;
  }
  return t;
}

/// Routed-expert bytes the busiest GPU of a replica reads per MoE layer when `tokens` tokens are
/// routed, and the expected distinct experts behind it.
struct ExpertReads {
  double bytes = 0;
  double experts = 0;
};

ExpertReads expertReads(const ModelShape& m, const ParallelLayout& layout, double tokens) {
  const double n = asDouble(m.n_routed_experts);
  const double distinct = expectedDistinctExperts(n, asDouble(m.experts_per_token), tokens);
  if (layout.ep <= 1) return {distinct * m.expert_bytes / asDouble(layout.tp), distinct};
  // Each EP rank holds n/ep experts; the busiest reads about one standard deviation more than
  // the mean of its share (Poisson-like spread of the routing), never more than it holds.
  const double held = n / asDouble(layout.ep);
  const double mean = distinct / asDouble(layout.ep);
  const double busiest = std::min(held, mean + std::sqrt(mean));
  return {busiest * m.expert_bytes / asDouble(layout.tp / layout.ep), busiest * asDouble(layout.ep)};
}

struct PassCost {
  double weights = 0;  ///< bytes per GPU
  double kv = 0;       ///< bytes per GPU
  double gemm_flops = 0;
  double attn_flops = 0;
  double collectives = 0;  ///< seconds
  std::int64_t collective_count = 0;
  double experts = 0;
};

/// Collectives of one pass through `layers` layers (`moe_layers` of them MoE) with `tokens`
/// tokens, plus the embedding allreduce and the logits all-gather of a vocab-parallel head.
void addCollectives(PassCost& cost, const PlanInput& in, const ParallelLayout& layout, std::int64_t layers,
                    std::int64_t moe_layers, double tokens) {
  if (layout.tp <= 1) return;
  const auto& m = in.model;
  const auto& hw = in.hardware;
  const std::int64_t nodes = replicaNodes(layout, hw);
  const double act = tokens * asDouble(m.hidden) * 2.0;  // BF16 activations
  const double allreduce = collectiveTime(hw, layout.tp, nodes, act, true);
  std::int64_t count = 0;
  double t = 0;
  // Attention output projection of every layer; dense MLPs and TP-sharded MoE reduce once more.
  t += asDouble(layers) * allreduce;
  count += layers;
  if (layout.ep > 1) {
    const double per_gpu_tokens = tokens / asDouble(layout.tp);
    const double dispatch = per_gpu_tokens * asDouble(m.experts_per_token * m.hidden) * (m.fp8_weights ? 1.0 : 2.0);
    const double combine = per_gpu_tokens * asDouble(m.experts_per_token * m.hidden) * 2.0;
    t += asDouble(moe_layers) *
         (collectiveTime(hw, layout.tp, nodes, dispatch, false) + collectiveTime(hw, layout.tp, nodes, combine, false));
    count += 2 * moe_layers;
    t += asDouble(layers - moe_layers) * allreduce;
    count += layers - moe_layers;
  } else {
    t += asDouble(layers) * allreduce;
    count += layers;
  }
  t += allreduce;                                                                      // vocab-parallel embedding
  t += collectiveTime(hw, layout.tp, nodes, tokens * asDouble(m.vocab) * 2.0, false);  // logits
  count += 2;
  cost.collectives += t;
  cost.collective_count += count;
}

double gemmPeak(const PlanInput& in) {
  const auto& hw = in.hardware;
  return (in.model.fp8_weights ? hw.fp8_flops : hw.bf16_flops) * hw.compute_efficiency;
}

double attnPeak(const PlanInput& in) {
  return in.hardware.bf16_flops * in.hardware.compute_efficiency;
}

double memBandwidth(const PlanInput& in) {
  return in.hardware.hbm_bandwidth * in.hardware.memory_efficiency;
}

/// Seconds of a pass: memory and compute overlap; collectives do not.
double passTime(const PlanInput& in, const PassCost& c) {
  const double mem = (c.weights + c.kv) / memBandwidth(in);
  const double comp = c.gemm_flops / gemmPeak(in) + c.attn_flops / attnPeak(in);
  return std::max(mem, comp) + c.collectives;
}

/// One draft pass of the MTP module(s) over `batch` sequences with `context` cached tokens.
PassCost mtpPass(const PlanInput& in, double batch, double context) {
  const auto& m = in.model;
  const auto& layout = in.decode;
  PassCost c;
  const ExpertReads er = expertReads(m, layout, batch);
  const double tp = asDouble(layout.tp);
  c.weights = m.mtp_fixed_bytes / tp + asDouble(m.mtp_moe_layers) * er.bytes;
  c.kv = batch * context * asDouble(m.kv_lora_rank + m.qk_rope_head_dim) * m.kv_dtype_bytes * asDouble(m.mtp_layers);
  c.gemm_flops =
      2.0 * batch * (m.mtp_fixed_params + asDouble(m.mtp_moe_layers * m.experts_per_token) * m.expert_params) / tp;
  c.attn_flops = 2.0 * asDouble(m.heads) * asDouble(2 * m.kv_lora_rank + m.qk_rope_head_dim) * context * batch *
                 asDouble(m.mtp_layers) / tp;
  addCollectives(c, in, layout, m.mtp_layers, m.mtp_moe_layers, batch);
  return c;
}

/// What the prompt's latent KV costs to send, seconds beyond the end of prefill compute.
double kvTransferExposed(const PlanInput& in, double kv_bytes, double prefill_seconds) {
  const auto& m = in.model;
  const double send = kv_bytes / in.hardware.net_bandwidth;
  const double kv_layers = asDouble(m.layers + (in.workload.mtp_k > 0 ? m.mtp_layers : 0));
  double exposed = send;
  if (in.kv_streaming && kv_layers > 0) {
    // Layer l is sent once computed: the last byte leaves after max(all compute + one layer's
    // send, one layer's compute + every send).
    const double per_layer_send = send / kv_layers;
    const double per_layer_compute = prefill_seconds / kv_layers;
    const double end = std::max(prefill_seconds + per_layer_send, per_layer_compute + send);
    exposed = end - prefill_seconds;
  }
  return exposed + in.hardware.net_latency;
}

double kvBytesPerToken(const PlanInput& in) {
  return in.workload.mtp_k > 0 ? in.model.kvBytesPerTokenWithMtp() : in.model.kvBytesPerTokenMain();
}

double decodeContext(const Workload& w) {
  return asDouble(w.input_len) + asDouble(w.output_len) / 2.0;
}

MemoryFit memoryFit(const PlanInput& in, double batch) {
  MemoryFit f;
  f.weight_bytes_per_gpu = in.model.total_weight_bytes / asDouble(in.decode.tp);
  const double per_seq = asDouble(in.workload.input_len + in.workload.output_len) * kvBytesPerToken(in);
  f.kv_bytes_per_gpu = batch * per_seq;
  f.usable_bytes_per_gpu = kHbmUsableFraction * in.hardware.hbm_capacity;
  const double room = f.usable_bytes_per_gpu - f.weight_bytes_per_gpu;
  f.max_batch_per_replica = room > 0 ? static_cast<std::int64_t>(std::floor(room / per_seq)) : 0;
  f.fits = room > 0 && batch <= asDouble(f.max_batch_per_replica);
  return f;
}

double md1Wait(double rho, double service) {
  return rho < 1.0 ? rho * service / (2.0 * (1.0 - rho)) : kInf;
}

std::int64_t ceilDiv(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

Status checkPositive(double v, std::string_view what) {
  if (!(v > 0) || !std::isfinite(v)) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("{} must be a positive number (got {})", what, v));
  }
  return okStatus();
}

Status checkLayout(const ParallelLayout& l, const HardwareProfile& hw, std::string_view pool) {
  if (l.tp < 1 || l.ep < 1 || l.dp < 1 || l.nodes < 0) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{} layout: tp, ep and dp must be >= 1 and nodes >= 0 (got tp {}, ep {}, dp {}, "
                                 "nodes {})",
                                 pool, l.tp, l.ep, l.dp, l.nodes));
  }
  if (l.tp % l.ep != 0) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("{} layout: ep {} must divide tp {} (experts are split tp/ep ways)", pool, l.ep, l.tp));
  }
  const std::int64_t nodes = replicaNodes(l, hw);
  if (l.tp % nodes != 0) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{} layout: tp {} is not a multiple of nodes {}", pool, l.tp, nodes));
  }
  if (l.tp / nodes > hw.gpus_per_node) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{} layout: tp {} over {} node(s) needs {} GPUs per node; {} has {} (raise nodes or "
                                 "gpus_per_node)",
                                 pool, l.tp, nodes, l.tp / nodes, hw.name, hw.gpus_per_node));
  }
  return okStatus();
}

}  // namespace

// ---- Model shape ----

double ModelShape::activatedParams() const {
  return main_fixed_params + asDouble(moe_layers * experts_per_token) * expert_params;
}

double ModelShape::activatedBytes() const {
  return main_fixed_bytes + asDouble(moe_layers * experts_per_token) * expert_bytes;
}

double ModelShape::kvBytesPerTokenMain() const {
  return asDouble(kv_lora_rank + qk_rope_head_dim) * asDouble(layers) * kv_dtype_bytes;
}

double ModelShape::kvBytesPerTokenWithMtp() const {
  return asDouble(kv_lora_rank + qk_rope_head_dim) * asDouble(layers + mtp_layers) * kv_dtype_bytes;
}

Result<ModelShape> shapeFromConfig(const ModelConfig& config, std::string name) {
  if (Status st = config.validate(); !st.ok()) return st.error();
  ModelShape s;
  s.name = std::move(name);
  s.layers = config.num_hidden_layers;
  s.mtp_layers = config.num_nextn_predict_layers;
  for (std::int64_t l = 0; l < config.kvLayers(); ++l) {
    if (!config.isMoeLayer(l)) continue;
    (l < config.num_hidden_layers ? s.moe_layers : s.mtp_moe_layers) += 1;
  }
  s.hidden = config.hidden_size;
  s.vocab = config.vocab_size;
  s.heads = config.num_attention_heads;
  s.kv_lora_rank = config.kv_lora_rank;
  s.qk_nope_head_dim = config.qk_nope_head_dim;
  s.qk_rope_head_dim = config.qk_rope_head_dim;
  s.v_head_dim = config.v_head_dim;
  s.n_routed_experts = config.n_routed_experts;
  s.experts_per_token = config.num_experts_per_tok;
  s.fp8_weights = config.quantization.has_value();

  double routed_bytes = 0;
  double routed_params = 0;
  for (const TensorSpec& spec : expectedTensors(config)) {
    double numel = 1;
    for (const std::int64_t d : spec.shape) numel *= asDouble(d);
    const double bytes = numel * asDouble(static_cast<std::int64_t>(dtypeSize(spec.dtype)));
    s.total_weight_bytes += bytes;
    if (!spec.is_scale) s.total_params += numel;
    const std::string_view n = spec.name;
    const bool mtp = tools::layerOf(n) >= config.num_hidden_layers;
    if (n.find(".mlp.experts.") != std::string_view::npos) {
      if (!mtp) {
        routed_bytes += bytes;
        if (!spec.is_scale) routed_params += numel;
      }
      continue;
    }
    const bool embed = n.ends_with("embed_tokens.weight");
    const bool matrix = spec.shape.size() == 2 && !embed && !spec.is_scale;
    // A step reads one embedding row per token, and every other weight whole.
    const double read = embed ? bytes / asDouble(config.vocab_size) : bytes;
    (mtp ? s.mtp_fixed_bytes : s.main_fixed_bytes) += read;
    if (matrix) (mtp ? s.mtp_fixed_params : s.main_fixed_params) += numel;
    if (n == "lm_head.weight" || (config.tie_word_embeddings && n == "model.embed_tokens.weight")) {
      s.lm_head_bytes = bytes;
      s.lm_head_params = numel;
    }
  }
  if (config.tie_word_embeddings) {  // the tied head reads the whole table
    s.main_fixed_bytes += s.lm_head_bytes;
    s.main_fixed_params += s.lm_head_params;
  }
  if (s.moe_layers > 0 && s.n_routed_experts > 0) {
    const double experts = asDouble(s.moe_layers * s.n_routed_experts);
    s.expert_bytes = routed_bytes / experts;
    s.expert_params = routed_params / experts;
  }
  return s;
}

std::vector<std::string> modelPresetNames() {
  std::vector<std::string> names = {"deepseek-v3", "deepseek-v3-bf16"};
  for (auto& p : presetNames()) names.push_back(std::move(p));
  return names;
}

Result<ModelShape> presetShape(std::string_view name) {
  if (name == "deepseek-v3" || name == "deepseek-v3-bf16") {
    auto config = presetConfig("deepseek-v3-layers=61");
    if (!config.ok()) return config.error();
    if (name == "deepseek-v3") config->quantization = Fp8Quantization{};
    return shapeFromConfig(config.value(), std::string(name));
  }
  auto config = presetConfig(name);
  if (!config.ok()) {
    std::string names;
    for (const auto& n : modelPresetNames()) names += (names.empty() ? "" : ", ") + n;
    return makeError(ErrorCode::InvalidArgument, fmt::format("unknown model preset '{}' (one of: {})", name, names));
  }
  return shapeFromConfig(config.value(), std::string(name));
}

// ---- Hardware ----

std::vector<std::string> hardwareNames() {
  return {"h200", "h800", "h100", "h20", "rtx4090"};
}

Result<HardwareProfile> builtinHardware(std::string_view name) {
  HardwareProfile h;
  h.name = std::string(name);
  // Every profile starts with the published H20 cluster's network (400 Gb/s per GPU, 0.193 ms)
  // and the two constants fitted to it; calibrate or override them for another network.
  h.net_bandwidth = 50e9;
  h.net_latency = 0.193e-3;
  h.net_collective_overhead = kFittedNetCollectiveOverhead;
  h.net_latency_hops = kFittedNetLatencyHops;
  h.nvlink_latency = 10e-6;
  if (name == "h200") {
    h.hbm_bandwidth = 4.8e12;
    h.hbm_capacity = 141e9;
    h.bf16_flops = 989.5e12;
    h.fp8_flops = 1979e12;
    h.nvlink_bandwidth = 450e9;
  } else if (name == "h800") {
    h.hbm_bandwidth = 3.35e12;
    h.hbm_capacity = 80e9;
    h.bf16_flops = 989.5e12;
    h.fp8_flops = 1979e12;
    h.nvlink_bandwidth = 200e9;
  } else if (name == "h100") {
    h.hbm_bandwidth = 3.35e12;
    h.hbm_capacity = 80e9;
    h.bf16_flops = 989.5e12;
    h.fp8_flops = 1979e12;
    h.nvlink_bandwidth = 450e9;
  } else if (name == "h20") {
    h.hbm_bandwidth = 4.0e12;
    h.hbm_capacity = 96e9;
    h.bf16_flops = 148e12;
    h.fp8_flops = 296e12;
    h.nvlink_bandwidth = 450e9;
  } else if (name == "rtx4090") {
    h.hbm_bandwidth = 1008e9;
    h.hbm_capacity = 24e9;
    h.bf16_flops = 165.2e12;
    h.fp8_flops = 330.3e12;
    h.nvlink_bandwidth = 25e9;  // no NVLink: PCIe 4.0 x16
    h.nvlink_latency = 30e-6;
    h.net_bandwidth = 12.5e9;  // 100 GbE
  } else {
    std::string names;
    for (const auto& n : hardwareNames()) names += (names.empty() ? "" : ", ") + n;
    return makeError(ErrorCode::InvalidArgument, fmt::format("unknown hardware '{}' (one of: {})", name, names));
  }
  return h;
}

// ---- Model ----

double expectedDistinctExperts(double n, double k, double tokens) {
  if (n <= 0 || k <= 0 || tokens <= 0) return 0.0;
  return n * (1.0 - std::pow(1.0 - std::min(k, n) / n, tokens));
}

double mtpTokensPerStep(std::int64_t k, double acceptance) {
  double tokens = 1.0;
  double p = 1.0;
  for (std::int64_t i = 1; i <= k; ++i) {
    p *= acceptance;
    tokens += p;
  }
  return tokens;
}

Status validate(const PlanInput& in) {
  const auto& m = in.model;
  const auto& hw = in.hardware;
  const auto& w = in.workload;
  if (m.layers < 1 || m.hidden < 1 || m.heads < 1 || m.vocab < 1) {
    return makeError(ErrorCode::InvalidArgument, "model shape: layers, hidden size, heads and vocab must be >= 1");
  }
  if (!(m.kv_dtype_bytes > 0)) return makeError(ErrorCode::InvalidArgument, "model shape: kv dtype bytes must be > 0");
  for (const auto& [v, what] :
       {std::pair{hw.hbm_bandwidth, "hbm bandwidth"}, std::pair{hw.hbm_capacity, "hbm capacity"},
        std::pair{hw.bf16_flops, "bf16 FLOP/s"}, std::pair{hw.fp8_flops, "fp8 FLOP/s"},
        std::pair{hw.nvlink_bandwidth, "nvlink bandwidth"}, std::pair{hw.net_bandwidth, "network bandwidth"},
        std::pair{hw.memory_efficiency, "memory efficiency"}, std::pair{hw.compute_efficiency, "compute efficiency"}}) {
    if (Status st = checkPositive(v, what); !st.ok()) return st;
  }
  for (const auto& [v, what] :
       {std::pair{hw.nvlink_latency, "nvlink latency"}, std::pair{hw.net_latency, "network latency"},
        std::pair{hw.net_collective_overhead, "network collective overhead"},
        std::pair{hw.net_latency_hops, "network latency hops"}}) {
    if (!(v >= 0) || !std::isfinite(v)) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("{} must be >= 0 (got {})", what, v));
    }
  }
  if (hw.gpus_per_node < 1) return makeError(ErrorCode::InvalidArgument, "gpus per node must be >= 1");
  if (Status st = checkLayout(in.decode, hw, "decode"); !st.ok()) return st;
  if (Status st = checkLayout(in.prefill, hw, "prefill"); !st.ok()) return st;
  if (w.input_len < 1 || w.output_len < 1 || w.concurrency < 1) {
    return makeError(ErrorCode::InvalidArgument, "workload: input length, output length and concurrency must be >= 1");
  }
  if (!(w.request_rate >= 0) || !std::isfinite(w.request_rate)) {
    return makeError(ErrorCode::InvalidArgument, "workload: request rate must be >= 0");
  }
  if (w.mtp_k < 0) return makeError(ErrorCode::InvalidArgument, "workload: mtp k must be >= 0");
  if (!(w.mtp_acceptance >= 0 && w.mtp_acceptance <= 1)) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("workload: mtp acceptance must be in 0..1 (got {})", w.mtp_acceptance));
  }
  if (w.mtp_k > 0 && m.mtp_layers < 1) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("workload: mtp k {} needs an MTP layer; model {} has none", w.mtp_k, m.name));
  }
  if (Status st = checkPositive(in.slo.ttft, "TTFT SLO"); !st.ok()) return st;
  if (Status st = checkPositive(in.slo.tpot, "TPOT SLO"); !st.ok()) return st;
  return okStatus();
}

StepBreakdown decodeStep(const PlanInput& in, double batch, double context) {
  const auto& m = in.model;
  const auto& layout = in.decode;
  const std::int64_t k = in.workload.mtp_k;
  const double tokens = batch * asDouble(1 + k);  // the verify pass scores the k drafts too
  const double tp = asDouble(layout.tp);

  PassCost main;
  const ExpertReads er = expertReads(m, layout, tokens);
  main.experts = er.experts;
  main.weights = m.main_fixed_bytes / tp + asDouble(m.moe_layers) * er.bytes;
  // MLA's latent KV is the same on every TP rank, and every rank's heads read all of it.
  main.kv = batch * context * m.kvBytesPerTokenMain();
  main.gemm_flops = 2.0 * tokens * m.activatedParams() / tp;
  main.attn_flops = 2.0 * asDouble(m.heads) * asDouble(2 * m.kv_lora_rank + m.qk_rope_head_dim) * context * tokens *
                    asDouble(m.layers) / tp;
  addCollectives(main, in, layout, m.layers, m.moe_layers, tokens);

  StepBreakdown s;
  const double bw = memBandwidth(in);
  s.weight_reads = main.weights / bw;
  s.kv_reads = main.kv / bw;
  s.compute = main.gemm_flops / gemmPeak(in) + main.attn_flops / attnPeak(in);
  s.compute_bound = s.compute > s.weight_reads + s.kv_reads;
  s.collectives = main.collectives;
  s.collectives_per_step = main.collective_count;
  s.experts_read_per_layer = main.experts;
  s.weight_bytes_per_gpu = main.weights;
  s.kv_bytes_per_gpu = main.kv;
  if (k > 0) {
    const PassCost draft = mtpPass(in, batch, context);
    s.mtp_draft = asDouble(k) * passTime(in, draft);
    s.collectives_per_step += k * draft.collective_count;
  }
  s.tokens_per_step = mtpTokensPerStep(k, in.workload.mtp_acceptance);
  s.total = std::max(s.weight_reads + s.kv_reads, s.compute) + s.collectives + s.mtp_draft;
  return s;
}

DecodePrediction predictDecode(const PlanInput& in, std::int64_t concurrency, std::int64_t decode_replicas) {
  DecodePrediction d;
  d.batch_per_replica = asDouble(ceilDiv(concurrency, std::max<std::int64_t>(1, decode_replicas)));
  d.step = decodeStep(in, d.batch_per_replica, decodeContext(in.workload));
  d.tokens_per_s_per_user = d.step.tokens_per_step / d.step.total;
  d.tokens_per_s_total = d.tokens_per_s_per_user * asDouble(concurrency);
  d.tpot = 1.0 / d.tokens_per_s_per_user;
  return d;
}

double prefillTime(const PlanInput& in, std::int64_t prompt_len) {
  const auto& m = in.model;
  const auto& layout = in.prefill;
  const double tokens = asDouble(prompt_len);
  const double tp = asDouble(layout.tp);
  const bool with_mtp = in.workload.mtp_k > 0;
  PassCost c;
  const ExpertReads er = expertReads(m, layout, tokens);
  c.weights = m.main_fixed_bytes / tp + asDouble(m.moe_layers) * er.bytes;
  // Every prompt token goes through every layer; only the last needs logits.
  c.gemm_flops = (2.0 * tokens * (m.activatedParams() - m.lm_head_params) + 2.0 * m.lm_head_params) / tp;
  // Causal attention, not absorbed: QK^T over qk_head_dim and PV over v_head_dim, half the square.
  const double attn_per_layer =
      asDouble(m.heads) * asDouble(m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * tokens * tokens;
  c.attn_flops = attn_per_layer * asDouble(m.layers) / tp;
  addCollectives(c, in, layout, m.layers, m.moe_layers, tokens);
  if (with_mtp) {  // the MTP layer's own KV is computed too (its head is not needed)
    const double head = asDouble(m.vocab * m.hidden);
    c.weights += m.mtp_fixed_bytes / tp + asDouble(m.mtp_moe_layers) * er.bytes;
    c.gemm_flops += 2.0 * tokens *
                    (std::max(0.0, m.mtp_fixed_params - head) +
                     asDouble(m.mtp_moe_layers * m.experts_per_token) * m.expert_params) /
                    tp;
    c.attn_flops += attn_per_layer * asDouble(m.mtp_layers) / tp;
    addCollectives(c, in, layout, m.mtp_layers, m.mtp_moe_layers, tokens);
  }
  return passTime(in, c);
}

TtftBreakdown predictTtft(const PlanInput& in, std::int64_t prefill_replicas, double tpot) {
  const auto& w = in.workload;
  TtftBreakdown t;
  t.prefill_compute = prefillTime(in, w.input_len);
  t.kv_transfer = kvTransferExposed(in, asDouble(w.input_len) * kvBytesPerToken(in), t.prefill_compute);
  const double service = t.prefill_compute;
  const std::int64_t np = std::max<std::int64_t>(1, prefill_replicas);
  const double replicas = asDouble(np);
  const double base = t.prefill_compute + t.kv_transfer;
  if (w.request_rate > 0) {
    t.arrival_rate = w.request_rate;
    t.prefill_utilization = w.request_rate * service / replicas;
    t.queueing = md1Wait(t.prefill_utilization, service);
    t.saturated = !std::isfinite(t.queueing);
  } else {
    // Closed loop of C users: arrival rate C / (TTFT + (output_len - 1) TPOT). M/D/1 waiting,
    // scaled by (C - 1) / C (a user never waits behind itself) and capped by everyone else's
    // prompt being ahead, (ceil(C / replicas) - 1) x service. Waiting falls as TTFT grows, so the
    // fixed point is unique: bisection.
    const double users = asDouble(w.concurrency);
    const double cap = asDouble(std::max<std::int64_t>(0, ceilDiv(w.concurrency, np) - 1)) * service;
    const auto wait = [&](double ttft, double* rate, double* rho) {
      *rate = users / (ttft + asDouble(w.output_len - 1) * tpot);
      *rho = *rate * service / replicas;
      return std::min(md1Wait(*rho, service) * (users - 1.0) / users, cap);
    };
    double lo = base;
    double hi = base + cap;
    for (int i = 0; i < 200 && hi - lo > 1e-12 * std::max(1.0, hi); ++i) {
      const double mid = 0.5 * (lo + hi);
      double rate = 0;
      double rho = 0;
      if (base + wait(mid, &rate, &rho) > mid) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    t.queueing = wait(hi, &t.arrival_rate, &t.prefill_utilization);
  }
  t.total = t.queueing + base;
  return t;
}

namespace {

PoolRatio cheapestPools(const PlanInput& in) {
  PoolRatio best;
  const auto& w = in.workload;
  const std::int64_t users = w.concurrency;
  const DecodePrediction one = predictDecode(in, 1, 1);
  if (one.tpot > in.slo.tpot) {
    best.reason = fmt::format("decode of a single user takes {:.2f} ms per token, above the TPOT SLO of {:.2f} ms",
                              one.tpot * 1e3, in.slo.tpot * 1e3);
    return best;
  }
  const double alone = prefillTime(in, w.input_len);
  const double base_ttft = alone + kvTransferExposed(in, asDouble(w.input_len) * kvBytesPerToken(in), alone);
  if (base_ttft > in.slo.ttft) {
    best.reason = fmt::format("prefill and KV transfer of one prompt take {:.2f} ms, above the TTFT SLO of {:.2f} ms",
                              base_ttft * 1e3, in.slo.ttft * 1e3);
    return best;
  }
  const std::int64_t decode_gpus = in.decode.tp;
  const std::int64_t prefill_gpus = in.prefill.tp;
  std::int64_t best_cost = std::numeric_limits<std::int64_t>::max();
  std::string last_reason = "no decode replica count up to the concurrency meets the TPOT SLO within memory";
  for (std::int64_t nd = 1; nd <= users; ++nd) {
    if (nd * decode_gpus >= best_cost) break;
    const DecodePrediction d = predictDecode(in, users, nd);
    if (d.tpot > in.slo.tpot) continue;
    if (!memoryFit(in, d.batch_per_replica).fits) continue;
    // The fewest prefill replicas meeting the TTFT SLO: more never hurts, so bisect.
    // Open loop: enough replicas to keep utilization at one half is always enough to try.
    const auto open_np = static_cast<std::int64_t>(std::ceil(2.0 * w.request_rate * alone)) + 1;
    const std::int64_t max_np = std::min<std::int64_t>(std::max<std::int64_t>(users, open_np), 1 << 20);
    if (predictTtft(in, max_np, d.tpot).total > in.slo.ttft) {
      last_reason = fmt::format("the TTFT SLO is not met even with {} prefill replicas", max_np);
      continue;
    }
    std::int64_t lo = 1;
    std::int64_t hi = max_np;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (predictTtft(in, mid, d.tpot).total <= in.slo.ttft) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const std::int64_t cost = nd * decode_gpus + lo * prefill_gpus;
    if (cost < best_cost) {
      best_cost = cost;
      best.feasible = true;
      best.decode_replicas = nd;
      best.prefill_replicas = lo;
      best.decode_gpus = nd * decode_gpus;
      best.prefill_gpus = lo * prefill_gpus;
      best.ratio = asDouble(best.prefill_gpus) / asDouble(best.decode_gpus);
      best.tpot = d.tpot;
      best.ttft = predictTtft(in, lo, d.tpot).total;
    }
  }
  if (!best.feasible) best.reason = last_reason;
  return best;
}

}  // namespace

Result<Prediction> predict(const PlanInput& in) {
  if (Status st = validate(in); !st.ok()) return st.error();
  Prediction p;
  p.decode = predictDecode(in, in.workload.concurrency, in.decode.dp);
  p.ttft = predictTtft(in, in.prefill.dp, p.decode.tpot);
  p.memory = memoryFit(in, p.decode.batch_per_replica);
  p.pools = cheapestPools(in);
  p.single_stream_ceiling_tokens_per_s = in.hardware.hbm_bandwidth / in.model.activatedBytes();
  p.mtp_tokens_per_step = mtpTokensPerStep(in.workload.mtp_k, in.workload.mtp_acceptance);
  p.kv_bytes_per_token = kvBytesPerToken(in);
  p.kv_bytes_per_request = asDouble(in.workload.input_len + in.workload.output_len) * p.kv_bytes_per_token;
  p.kv_transfer_bytes_per_request = asDouble(in.workload.input_len) * p.kv_bytes_per_token;
  return p;
}

// ---- Calibration ----

namespace {

double predictPoint(const PlanInput& in, const CalibrationPoint& point) {
  PlanInput at = in;
  if (point.net_latency >= 0) at.hardware.net_latency = point.net_latency;
  const double batch = asDouble(ceilDiv(point.concurrency, in.decode.dp));
  const double context = point.context >= 0 ? point.context : decodeContext(in.workload);
  const StepBreakdown s = decodeStep(at, batch, context);
  return s.tokens_per_step / s.total * asDouble(point.concurrency);
}

/// Least squares on step time vs latency: (measured - step without network terms) / count =
/// overhead + hops x latency.
Result<HardwareProfile> fitNetwork(const PlanInput& in, const std::vector<CalibrationPoint>& points) {
  PlanInput bare = in;
  bare.hardware.net_collective_overhead = 0;
  bare.hardware.net_latency_hops = 0;
  double sx = 0;
  double sy = 0;
  double sxx = 0;
  double sxy = 0;
  for (const auto& p : points) {
    PlanInput at = bare;
    at.hardware.net_latency = p.net_latency;
    const double batch = asDouble(ceilDiv(p.concurrency, in.decode.dp));
    const double context = p.context >= 0 ? p.context : decodeContext(in.workload);
    const StepBreakdown s = decodeStep(at, batch, context);
    const double measured_step = s.tokens_per_step * asDouble(p.concurrency) / p.tokens_per_s_total;
    // Every collective of a replica spanning nodes crosses the network once per step.
    const double z = (measured_step - s.total) / asDouble(s.collectives_per_step);
    sx += p.net_latency;
    sy += z;
    sxx += p.net_latency * p.net_latency;
    sxy += p.net_latency * z;
  }
  const double n = asDouble(static_cast<std::int64_t>(points.size()));
  HardwareProfile hw = in.hardware;
  const double denom = n * sxx - sx * sx;
  double hops = (n * sxy - sx * sy) / denom;
  double overhead = (sy - hops * sx) / n;
  if (overhead < 0) {  // through the origin instead
    overhead = 0;
    hops = sxy / sxx;
  }
  hw.net_collective_overhead = overhead;
  hw.net_latency_hops = std::max(0.0, hops);
  return hw;
}

double logError(const PlanInput& in, const std::vector<CalibrationPoint>& points, const HardwareProfile& prior) {
  double e = 0;
  for (const auto& p : points) {
    const double r = std::log(predictPoint(in, p) / p.tokens_per_s_total);
    e += r * r;
  }
  // A faint pull towards the prior keeps a constant the data cannot see (compute efficiency of a
  // purely memory-bound sweep) where it was.
  const double dm = std::log(in.hardware.memory_efficiency / prior.memory_efficiency);
  const double dc = std::log(in.hardware.compute_efficiency / prior.compute_efficiency);
  return e + 1e-6 * (dm * dm + dc * dc);
}

HardwareProfile fitEfficiency(const PlanInput& in, const std::vector<CalibrationPoint>& points) {
  PlanInput at = in;
  double lo_m = std::log(0.005);
  double hi_m = std::log(2.0);
  double lo_c = std::log(0.002);
  double hi_c = std::log(2.0);
  double best_m = std::log(in.hardware.memory_efficiency);
  double best_c = std::log(in.hardware.compute_efficiency);
  double best = logError(in, points, in.hardware);
  constexpr int kSteps = 40;
  for (int round = 0; round < 6; ++round) {
    const double step_m = (hi_m - lo_m) / kSteps;
    const double step_c = (hi_c - lo_c) / kSteps;
    for (int i = 0; i <= kSteps; ++i) {
      for (int j = 0; j <= kSteps; ++j) {
        at.hardware.memory_efficiency = std::exp(lo_m + step_m * i);
        at.hardware.compute_efficiency = std::exp(lo_c + step_c * j);
        const double e = logError(at, points, in.hardware);
        if (e < best) {
          best = e;
          best_m = lo_m + step_m * i;
          best_c = lo_c + step_c * j;
        }
      }
    }
    lo_m = best_m - 2 * step_m;
    hi_m = best_m + 2 * step_m;
    lo_c = best_c - 2 * step_c;
    hi_c = best_c + 2 * step_c;
  }
  HardwareProfile hw = in.hardware;
  hw.memory_efficiency = std::exp(best_m);
  hw.compute_efficiency = std::exp(best_c);
  return hw;
}

}  // namespace

Result<CalibrationResult> calibrate(const PlanInput& input, const std::vector<CalibrationPoint>& points) {
  if (Status st = validate(input); !st.ok()) return st.error();
  if (points.empty()) return makeError(ErrorCode::InvalidArgument, "calibration needs at least one measured point");
  std::set<double> latencies;
  for (const auto& p : points) {
    if (p.concurrency < 1 || !(p.tokens_per_s_total > 0) || !std::isfinite(p.tokens_per_s_total)) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("calibration point: concurrency must be >= 1 and tokens/s > 0 (got {} and {})",
                                   p.concurrency, p.tokens_per_s_total));
    }
    latencies.insert(p.net_latency >= 0 ? p.net_latency : input.hardware.net_latency);
  }
  CalibrationResult r;
  if (latencies.size() >= 2) {
    if (replicaNodes(input.decode, input.hardware) < 2 || input.decode.tp < 2) {
      return makeError(ErrorCode::InvalidArgument,
                       "points at several network latencies fit the network constants, which needs a decode replica "
                       "spanning two or more nodes (set nodes and decode tp)");
    }
    std::vector<CalibrationPoint> with_latency = points;
    for (auto& p : with_latency) {
      if (p.net_latency < 0) p.net_latency = input.hardware.net_latency;
    }
    auto hw = fitNetwork(input, with_latency);
    if (!hw.ok()) return hw.error();
    r.hardware = hw.value();
    r.fitted = "net_collective_overhead and net_latency_hops (least squares of step time against network latency)";
  } else {
    r.hardware = fitEfficiency(input, points);
    r.fitted = "memory_efficiency and compute_efficiency (least squared log error of tokens/s)";
  }
  PlanInput fitted = input;
  fitted.hardware = r.hardware;
  double se = 0;
  for (const auto& p : points) {
    const double pred = predictPoint(fitted, p);
    r.predicted_tokens_per_s_total.push_back(pred);
    const double rel = pred / p.tokens_per_s_total - 1.0;
    se += rel * rel;
  }
  r.rms_relative_error = std::sqrt(se / asDouble(static_cast<std::int64_t>(points.size())));
  return r;
}

}  // namespace pd::plan
