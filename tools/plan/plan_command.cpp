// `pdserve plan`'s command logic (plan_command.h): flags into a PlanInput, the calibration file,
// the reports.
#include "plan_command.h"

#include <fmt/format.h>
#include <fmt/printf.h>

#include <boost/json.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "pd/common/kv_format.h"

namespace pd::plan {
namespace {

Result<double> numberAt(const boost::json::object& o, std::string_view key, const std::string& where) {
  const auto* v = o.if_contains(key);
  if (v == nullptr) return makeError(ErrorCode::NotFound, fmt::format("{}: no \"{}\"", where, key));
  if (v->is_double()) return v->as_double();
  if (v->is_int64()) return static_cast<double>(v->as_int64());
  if (v->is_uint64()) return static_cast<double>(v->as_uint64());
  return makeError(ErrorCode::InvalidArgument, fmt::format("{}: \"{}\" must be a number", where, key));
}

/// The first of `keys` present as a number; NotFound when none is.
Result<double> firstNumber(const boost::json::object& o, std::initializer_list<std::string_view> keys,
                           const std::string& where) {
  for (const auto key : keys) {
    if (o.contains(key)) return numberAt(o, key, where);
  }
  std::string names;
  for (const auto key : keys) names += fmt::format("{}\"{}\"", names.empty() ? "" : " or ", key);
  return makeError(ErrorCode::InvalidArgument, fmt::format("{}: needs {}", where, names));
}

Result<ModelShape> resolveModel(const std::string& model) {
  std::error_code ec;
  if (std::filesystem::is_directory(model, ec)) {
    auto config = ModelConfig::load(model);
    if (!config.ok()) return config.error();
    return shapeFromConfig(config.value(), model);
  }
  auto shape = presetShape(model);
  if (!shape.ok()) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("--model {}: not a folder and not a preset; {}", model, shape.error().message));
  }
  return shape;
}

std::int64_t nodesOf(const ParallelLayout& l, const HardwareProfile& hw) {
  return l.nodes > 0 ? l.nodes : (l.tp + hw.gpus_per_node - 1) / hw.gpus_per_node;
}

/// One JSON object written in order; non-finite numbers become null.
class JsonObject {
 public:
  JsonObject& num(std::string_view key, double v) {
    return raw(key, std::isfinite(v) ? fmt::format("{:.10g}", v) : std::string("null"));
  }
  JsonObject& integer(std::string_view key, std::int64_t v) { return raw(key, std::to_string(v)); }
  JsonObject& boolean(std::string_view key, bool v) { return raw(key, v ? "true" : "false"); }
  JsonObject& str(std::string_view key, std::string_view v) {
    return raw(key, boost::json::serialize(boost::json::value(boost::json::string_view(v.data(), v.size()))));
  }
  JsonObject& obj(std::string_view key, const JsonObject& o) { return raw(key, o.text()); }
  JsonObject& raw(std::string_view key, const std::string& value) {
    body_ += fmt::format("{}\"{}\": {}", body_.empty() ? "" : ", ", key, value);
    return *this;
  }
  [[nodiscard]] std::string text() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

JsonObject hardwareJson(const HardwareProfile& h) {
  JsonObject o;
  o.str("name", h.name)
      .num("hbm_bandwidth_gbs", h.hbm_bandwidth / 1e9)
      .num("hbm_capacity_gb", h.hbm_capacity / 1e9)
      .num("bf16_tflops", h.bf16_flops / 1e12)
      .num("fp8_tflops", h.fp8_flops / 1e12)
      .integer("gpus_per_node", h.gpus_per_node)
      .num("nvlink_bandwidth_gbs", h.nvlink_bandwidth / 1e9)
      .num("nvlink_latency_us", h.nvlink_latency * 1e6)
      .num("net_bandwidth_gbs", h.net_bandwidth / 1e9)
      .num("net_latency_ms", h.net_latency * 1e3)
      .num("memory_efficiency", h.memory_efficiency)
      .num("compute_efficiency", h.compute_efficiency)
      .num("net_collective_overhead_us", h.net_collective_overhead * 1e6)
      .num("net_latency_hops", h.net_latency_hops);
  return o;
}

JsonObject layoutJson(const ParallelLayout& l, const HardwareProfile& hw) {
  JsonObject o;
  o.integer("tp", l.tp)
      .integer("ep", l.ep)
      .integer("dp", l.dp)
      .integer("nodes", nodesOf(l, hw))
      .integer("gpus", l.gpus());
  return o;
}

std::string ms(double seconds) {
  if (!std::isfinite(seconds)) return "unbounded";
  return fmt::format("{:.3f} ms", seconds * 1e3);
}

std::string gb(double bytes) {
  return fmt::format("{:.2f} GB", bytes / 1e9);
}

std::string planHeader(const PlanInput& in) {
  std::string out;
  const auto& m = in.model;
  const auto& h = in.hardware;
  out += fmt::sprintf("model: %s (%s weights; %.2f B activated of %.1f B parameters; %.2f GB read per batch-1 step)\n",
                      m.name.c_str(), m.fp8_weights ? "FP8" : "BF16", m.activatedParams() / 1e9, m.total_params / 1e9,
                      m.activatedBytes() / 1e9);
  out += fmt::sprintf(
      "hardware: %s: HBM %.0f GB/s, %.0f GB; FP8 %.1f / BF16 %.1f TFLOP/s; %lld GPUs/node; NVLink %.0f GB/s, "
      "%.1f us; network %.1f GB/s, %.3f ms\n",
      h.name.c_str(), h.hbm_bandwidth / 1e9, h.hbm_capacity / 1e9, h.fp8_flops / 1e12, h.bf16_flops / 1e12,
      static_cast<long long>(h.gpus_per_node), h.nvlink_bandwidth / 1e9, h.nvlink_latency * 1e6, h.net_bandwidth / 1e9,
      h.net_latency * 1e3);
  out += fmt::sprintf(
      "constants: memory efficiency %.3g, compute efficiency %.3g, cross-node collective overhead %.1f us, "
      "latency hops %.3g\n",
      h.memory_efficiency, h.compute_efficiency, h.net_collective_overhead * 1e6, h.net_latency_hops);
  return out;
}

}  // namespace

void registerPlanOptions(config::OptionSet& s, PlanFlags& f) {
  constexpr double kBig = 1e12;
  s.add("model", &f.model,
        "model: a preset (deepseek-v3, deepseek-v3-bf16, tiny, small, bench, default, "
        "deepseek-v3-layers=N) or a checkpoint folder with config.json; empty: deepseek-v3")
      .add("hardware", &f.hardware, "hardware profile: h200, h800, h100, h20, rtx4090; empty: h200")
      .add("hbm_bandwidth_gbs", &f.hbm_bandwidth_gbs, "memory bandwidth per GPU, GB/s (-1: the profile's)", -1, kBig)
      .add("hbm_capacity_gb", &f.hbm_capacity_gb, "memory per GPU, GB (-1: the profile's)", -1, kBig)
      .add("bf16_tflops", &f.bf16_tflops, "dense BF16 TFLOP/s per GPU (-1: the profile's)", -1, kBig)
      .add("fp8_tflops", &f.fp8_tflops, "dense FP8 TFLOP/s per GPU (-1: the profile's)", -1, kBig)
      .add("gpus_per_node", &f.gpus_per_node, "GPUs per node (0: the profile's)", 0, 1 << 20)
      .add("nvlink_bandwidth_gbs", &f.nvlink_bandwidth_gbs,
           "intra-node bandwidth per GPU per direction, GB/s (-1: "
           "the profile's)",
           -1, kBig)
      .add("nvlink_latency_us", &f.nvlink_latency_us, "one small intra-node collective, us (-1: the profile's)", -1,
           kBig)
      .add("net_bandwidth_gbs", &f.net_bandwidth_gbs,
           "network bandwidth per GPU between nodes, GB/s (-1: the "
           "profile's)",
           -1, kBig)
      .add("net_latency_ms", &f.net_latency_ms, "one-way network latency between nodes, ms (-1: the profile's)", -1,
           kBig)
      .add("memory_efficiency", &f.memory_efficiency, "fraction of HBM bandwidth reached (-1: the profile's, 1)", -1,
           10)
      .add("compute_efficiency", &f.compute_efficiency, "fraction of dense FLOP/s reached (-1: the profile's, 0.6)", -1,
           10)
      .add("net_collective_overhead_us", &f.net_collective_overhead_us,
           "fitted: cost of each cross-node collective besides latency, us (-1: the profile's)", -1, kBig)
      .add("net_latency_hops", &f.net_latency_hops,
           "fitted: network latencies each cross-node collective waits (-1: the profile's)", -1, 1e6)
      .add("decode_tp", &f.decode_tp, "GPUs per decode replica (0: fewest power of two holding the weights)", 0,
           1 << 20)
      .add("decode_ep", &f.decode_ep, "expert-parallel degree in a decode replica (divides decode_tp)", 1, 1 << 20)
      .add("decode_dp", &f.decode_dp, "decode replicas", 1, 1 << 20)
      .add("nodes", &f.nodes, "nodes one decode replica spans (0: ceil(decode_tp / gpus_per_node))", 0, 1 << 20)
      .add("prefill_tp", &f.prefill_tp, "GPUs per prefill replica (0: fewest power of two holding the weights)", 0,
           1 << 20)
      .add("prefill_ep", &f.prefill_ep, "expert-parallel degree in a prefill replica", 1, 1 << 20)
      .add("prefill_dp", &f.prefill_dp, "prefill replicas", 1, 1 << 20)
      .add("prefill_nodes", &f.prefill_nodes, "nodes one prefill replica spans (0: ceil(prefill_tp / gpus_per_node))",
           0, 1 << 20)
      .add("input_len", &f.input_len, "prompt tokens per request", 1, 1 << 30)
      .add("output_len", &f.output_len, "output tokens per request", 1, 1 << 30)
      .add("concurrency", &f.concurrency, "users with a request in flight (closed loop)", 1, 1000000)
      .add("request_rate", &f.request_rate, "open-loop Poisson arrivals into prefill, requests/s (0: closed loop)", 0,
           kBig)
      .add("mtp_k", &f.mtp_k, "MTP draft tokens per step (0: off)", 0, 16)
      .add("mtp_acceptance", &f.mtp_acceptance, "probability each draft is accepted given the previous was", 0, 1)
      .add("kv_dtype", &f.kv_dtype, "latent KV cache dtype", {"bf16", "fp8"})
      .add("kv_streaming", &f.kv_streaming, "KV streams layer by layer during prefill (false: sent afterwards)")
      .add("ttft_slo_ms", &f.ttft_slo_ms, "time-to-first-token SLO, ms", 1e-6, kBig)
      .add("tpot_slo_ms", &f.tpot_slo_ms, "time-per-output-token SLO, ms", 1e-6, kBig)
      .add("json", &f.json, "print one JSON object instead of text")
      .add("calibrate", &f.calibrate,
           "fit the efficiency constants to a bench JSON (pdserve bench engine --json, or the fields in "
           "docs/planner.md) and print predicted vs measured");
}

Result<CalibrationFile> readCalibrationFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return makeError(ErrorCode::NotFound, fmt::format("--calibrate {}: cannot open the file", path.string()));
  std::ostringstream text;
  text << in.rdbuf();
  boost::system::error_code ec;
  const boost::json::value doc = boost::json::parse(text.str(), ec);
  const std::string where = fmt::format("--calibrate {}", path.string());
  if (ec) return makeError(ErrorCode::InvalidArgument, fmt::format("{}: not JSON ({})", where, ec.message()));
  if (!doc.is_object()) return makeError(ErrorCode::InvalidArgument, where + ": must be a JSON object");
  const auto& o = doc.as_object();
  CalibrationFile b;
  if (const auto* m = o.if_contains("model"); m != nullptr && m->is_string()) b.model = std::string(m->as_string());
  if (const auto* h = o.if_contains("hardware"); h != nullptr && h->is_string()) {
    b.hardware = std::string(h->as_string());
  }
  for (const auto& [key, field] :
       {std::pair{"backend", &b.backend}, std::pair{"device", &b.device}, std::pair{"note", &b.note}}) {
    if (const auto* v = o.if_contains(key); v != nullptr && v->is_string()) *field = std::string(v->as_string());
  }
  const bool gpu_run = b.backend == "cuda";
  if (o.contains("gemm_bf16_tflops") && !o.at("gemm_bf16_tflops").is_null()) {
    auto v = numberAt(o, "gemm_bf16_tflops", where);
    if (!v.ok()) return v.error();
    if (!(*v > 0)) return makeError(ErrorCode::InvalidArgument, where + ": \"gemm_bf16_tflops\" must be > 0");
    b.gemm_bf16_tflops = *v;
  }
  for (const auto& [key, field] :
       {std::pair{"read_bandwidth_gbs", &b.read_bandwidth_gbs}, std::pair{"peak_gflops", &b.peak_gflops}}) {
    if (!o.contains(key)) continue;
    auto v = numberAt(o, key, where);
    if (!v.ok()) return v.error();
    if (!(*v > 0)) return makeError(ErrorCode::InvalidArgument, fmt::format("{}: \"{}\" must be > 0", where, key));
    *field = *v;
  }
  for (const auto& [key, field] : {std::pair{"tp", &b.tp}, std::pair{"nodes", &b.nodes}}) {
    if (!o.contains(key)) continue;
    auto v = numberAt(o, key, where);
    if (!v.ok()) return v.error();
    if (!(*v >= 1) || *v != std::floor(*v)) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("{}: \"{}\" must be an integer >= 1", where, key));
    }
    *field = static_cast<std::int64_t>(*v);
  }
  double context = -1;
  if (o.contains("context")) {
    auto v = numberAt(o, "context", where);
    if (!v.ok()) return v.error();
    context = *v;
  }
  double latency_ms = -1;
  if (o.contains("net_latency_ms")) {
    auto v = numberAt(o, "net_latency_ms", where);
    if (!v.ok()) return v.error();
    latency_ms = *v;
  }
  const boost::json::value* levels = o.if_contains("decode");
  if (levels == nullptr) levels = o.if_contains("levels");
  if (gpu_run) {
    // A GPU run (bench engine --device cuda) calibrates with its ceilings only: its "decode" steps
    // ran a make-model checkpoint of a few DeepSeek-V3 layers, not the planned model, so their
    // rates are not the planned model's (docs/planner.md).
    if (b.read_bandwidth_gbs <= 0 && b.gemm_bf16_tflops <= 0) {
      return makeError(ErrorCode::InvalidArgument,
                       where + ": a GPU run (backend cuda) needs \"read_bandwidth_gbs\" or \"gemm_bf16_tflops\"");
    }
    return b;
  }
  if (levels == nullptr || !levels->is_array() || levels->as_array().empty()) {
    return makeError(ErrorCode::InvalidArgument,
                     where + ": needs a non-empty array \"decode\" (or \"levels\") of measured decode levels");
  }
  std::size_t i = 0;
  for (const auto& level : levels->as_array()) {
    const std::string at = fmt::format("{}: level {}", where, i++);
    if (!level.is_object()) return makeError(ErrorCode::InvalidArgument, at + " must be an object");
    const auto& lo = level.as_object();
    auto concurrency = firstNumber(lo, {"concurrency", "batch"}, at);
    if (!concurrency.ok()) return concurrency.error();
    auto tps = firstNumber(lo, {"tokens_per_s", "output_tokens_per_s", "output_throughput"}, at);
    if (!tps.ok()) return tps.error();
    if (!(*concurrency >= 1) || *concurrency != std::floor(*concurrency)) {
      return makeError(ErrorCode::InvalidArgument, at + ": concurrency must be an integer >= 1");
    }
    CalibrationPoint p;
    p.concurrency = static_cast<std::int64_t>(*concurrency);
    p.tokens_per_s_total = *tps;
    p.context = context;
    if (lo.contains("context")) {
      auto c = numberAt(lo, "context", at);
      if (!c.ok()) return c.error();
      p.context = *c;
    }
    double lat = latency_ms;
    if (lo.contains("net_latency_ms")) {
      auto l = numberAt(lo, "net_latency_ms", at);
      if (!l.ok()) return l.error();
      lat = *l;
    }
    p.net_latency = lat >= 0 ? lat * 1e-3 : -1;
    b.points.push_back(p);
  }
  return b;
}

std::int64_t autoTp(const ModelShape& m, const HardwareProfile& hw) {
  std::int64_t tp = 1;
  while (tp < (1 << 20) && m.total_weight_bytes / static_cast<double>(tp) > kHbmUsableFraction * hw.hbm_capacity) {
    tp *= 2;
  }
  return tp;
}

Result<PlanInput> planInputFromFlags(const PlanFlags& f, const CalibrationFile* bench) {
  PlanInput in;
  std::string model = f.model;
  if (model.empty() && bench != nullptr) model = bench->model;
  if (model.empty()) model = "deepseek-v3";
  auto shape = resolveModel(model);
  if (!shape.ok()) return shape.error();
  in.model = std::move(shape).value();
  // FP8: e4m3 codes plus a float32 scale per 64 values (pd/common/kv_format.h): 612 bytes for
  // DeepSeek-V3's 576-value latent, 1.0625 a value.
  const std::int64_t latent = in.model.kv_lora_rank + in.model.qk_rope_head_dim;
  in.model.kv_dtype_bytes = f.kv_dtype == "fp8" ? static_cast<double>(kvTokenBytes(DType::F8E4M3, latent)) /
                                                      static_cast<double>(std::max<std::int64_t>(latent, 1))
                                                : 2.0;

  std::string hw_name = f.hardware;
  if (hw_name.empty() && bench != nullptr) hw_name = bench->hardware;
  if (hw_name.empty()) hw_name = "h200";
  auto hw = builtinHardware(hw_name);
  if (!hw.ok()) return makeError(ErrorCode::InvalidArgument, "--hardware: " + hw.error().message);
  in.hardware = std::move(hw).value();
  auto& h = in.hardware;
  if (bench != nullptr && bench->read_bandwidth_gbs > 0) {
    h.hbm_bandwidth = bench->read_bandwidth_gbs * 1e9;
    h.name = fmt::format("measured ({} profile for the rest)", h.name);
  }
  if (bench != nullptr && bench->peak_gflops > 0) {
    h.bf16_flops = bench->peak_gflops * 1e9;
    h.fp8_flops = bench->peak_gflops * 1e9;
  }
  if (bench != nullptr && bench->gemm_bf16_tflops > 0 && bench->peak_gflops <= 0) {
    // FP8 keeps the profile's FP8 : BF16 ratio (the GPU run measures BF16 GEMMs only).
    const double fp8_ratio = h.bf16_flops > 0 ? h.fp8_flops / h.bf16_flops : 1.0;
    h.bf16_flops = bench->gemm_bf16_tflops * 1e12;
    h.fp8_flops = h.bf16_flops * fp8_ratio;
  }
  const auto over = [](double flag, double scale, double& field) {
    if (flag >= 0) field = flag * scale;
  };
  over(f.hbm_bandwidth_gbs, 1e9, h.hbm_bandwidth);
  over(f.hbm_capacity_gb, 1e9, h.hbm_capacity);
  over(f.bf16_tflops, 1e12, h.bf16_flops);
  over(f.fp8_tflops, 1e12, h.fp8_flops);
  over(f.nvlink_bandwidth_gbs, 1e9, h.nvlink_bandwidth);
  over(f.nvlink_latency_us, 1e-6, h.nvlink_latency);
  over(f.net_bandwidth_gbs, 1e9, h.net_bandwidth);
  over(f.net_latency_ms, 1e-3, h.net_latency);
  over(f.memory_efficiency, 1.0, h.memory_efficiency);
  over(f.compute_efficiency, 1.0, h.compute_efficiency);
  over(f.net_collective_overhead_us, 1e-6, h.net_collective_overhead);
  over(f.net_latency_hops, 1.0, h.net_latency_hops);
  if (f.gpus_per_node > 0) h.gpus_per_node = f.gpus_per_node;

  const std::int64_t auto_tp = autoTp(in.model, h);
  in.decode = {f.decode_tp, f.decode_ep, f.decode_dp, f.nodes};
  if (in.decode.tp == 0) in.decode.tp = bench != nullptr && bench->tp > 0 ? bench->tp : auto_tp;
  if (in.decode.nodes == 0 && bench != nullptr) in.decode.nodes = bench->nodes;
  in.prefill = {f.prefill_tp == 0 ? auto_tp : f.prefill_tp, f.prefill_ep, f.prefill_dp, f.prefill_nodes};
  in.workload = {f.input_len, f.output_len, f.concurrency, f.request_rate, f.mtp_k, f.mtp_acceptance};
  in.slo = {f.ttft_slo_ms * 1e-3, f.tpot_slo_ms * 1e-3};
  in.kv_streaming = f.kv_streaming;
  return in;
}

std::string planReportJson(const PlanInput& in, const Prediction& p) {
  const auto& s = p.decode.step;
  JsonObject step;
  step.num("total", s.total * 1e3)
      .num("weight_reads", s.weight_reads * 1e3)
      .num("kv_reads", s.kv_reads * 1e3)
      .num("compute", s.compute * 1e3)
      .num("collectives", s.collectives * 1e3)
      .num("mtp_draft", s.mtp_draft * 1e3)
      .str("bound", s.compute_bound ? "compute" : "memory")
      .integer("collectives_per_step", s.collectives_per_step)
      .num("experts_read_per_layer", s.experts_read_per_layer)
      .num("tokens_per_step", s.tokens_per_step)
      .num("weight_bytes_per_gpu", s.weight_bytes_per_gpu)
      .num("kv_bytes_per_gpu", s.kv_bytes_per_gpu);
  JsonObject ttft;
  ttft.num("total", p.ttft.total * 1e3)
      .num("queueing", p.ttft.queueing * 1e3)
      .num("prefill_compute", p.ttft.prefill_compute * 1e3)
      .num("kv_transfer", p.ttft.kv_transfer * 1e3)
      .num("arrival_rate_per_s", p.ttft.arrival_rate)
      .num("prefill_utilization", p.ttft.prefill_utilization)
      .boolean("saturated", p.ttft.saturated);
  JsonObject memory;
  memory.num("weight_bytes_per_gpu", p.memory.weight_bytes_per_gpu)
      .num("kv_bytes_per_gpu", p.memory.kv_bytes_per_gpu)
      .num("usable_bytes_per_gpu", p.memory.usable_bytes_per_gpu)
      .integer("max_batch_per_replica", p.memory.max_batch_per_replica)
      .boolean("fits", p.memory.fits);
  JsonObject pools;
  pools.boolean("feasible", p.pools.feasible);
  if (p.pools.feasible) {
    pools.num("ratio", p.pools.ratio)
        .integer("prefill_replicas", p.pools.prefill_replicas)
        .integer("decode_replicas", p.pools.decode_replicas)
        .integer("prefill_gpus", p.pools.prefill_gpus)
        .integer("decode_gpus", p.pools.decode_gpus)
        .integer("total_gpus", p.pools.prefill_gpus + p.pools.decode_gpus)
        .num("ttft_ms", p.pools.ttft * 1e3)
        .num("tpot_ms", p.pools.tpot * 1e3);
  } else {
    pools.str("reason", p.pools.reason);
  }
  const auto& w = in.workload;
  JsonObject workload;
  workload.integer("input_len", w.input_len)
      .integer("output_len", w.output_len)
      .integer("concurrency", w.concurrency)
      .num("request_rate", w.request_rate)
      .integer("mtp_k", w.mtp_k)
      .num("mtp_acceptance", w.mtp_acceptance)
      .boolean("kv_streaming", in.kv_streaming);
  JsonObject slo;
  slo.num("ttft_ms", in.slo.ttft * 1e3).num("tpot_ms", in.slo.tpot * 1e3);
  JsonObject model;
  model.str("name", in.model.name)
      .str("weights", in.model.fp8_weights ? "fp8" : "bf16")
      .num("activated_params", in.model.activatedParams())
      .num("activated_bytes", in.model.activatedBytes())
      .num("total_params", in.model.total_params)
      .num("total_weight_bytes", in.model.total_weight_bytes);

  JsonObject out;
  out.obj("model", model)
      .obj("hardware", hardwareJson(in.hardware))
      .obj("decode_layout", layoutJson(in.decode, in.hardware))
      .obj("prefill_layout", layoutJson(in.prefill, in.hardware))
      .obj("workload", workload)
      .obj("slo", slo)
      .num("decode_tokens_per_s_per_user", p.decode.tokens_per_s_per_user)
      .num("decode_tokens_per_s_total", p.decode.tokens_per_s_total)
      .num("tpot_ms", p.decode.tpot * 1e3)
      .num("batch_per_replica", p.decode.batch_per_replica)
      .obj("step_time_ms", step)
      .obj("ttft_ms", ttft)
      .num("kv_bytes_per_token", p.kv_bytes_per_token)
      .num("kv_bytes_per_request", p.kv_bytes_per_request)
      .num("kv_transfer_bytes_per_request", p.kv_transfer_bytes_per_request)
      .obj("memory", memory)
      .obj("prefill_decode_ratio", pools)
      .num("single_stream_ceiling_tokens_per_s", p.single_stream_ceiling_tokens_per_s)
      .num("mtp_tokens_per_step", p.mtp_tokens_per_step);
  return out.text();
}

std::string planReportText(const PlanInput& in, const Prediction& p) {
  std::string out = planHeader(in);
  const auto& h = in.hardware;
  const auto& w = in.workload;
  out += fmt::sprintf(
      "layout: decode tp %lld (ep %lld) over %lld node(s) x dp %lld; prefill tp %lld (ep %lld) over %lld "
      "node(s) x dp %lld\n",
      static_cast<long long>(in.decode.tp), static_cast<long long>(in.decode.ep),
      static_cast<long long>(nodesOf(in.decode, h)), static_cast<long long>(in.decode.dp),
      static_cast<long long>(in.prefill.tp), static_cast<long long>(in.prefill.ep),
      static_cast<long long>(nodesOf(in.prefill, h)), static_cast<long long>(in.prefill.dp));
  out += fmt::sprintf("workload: input %lld, output %lld, concurrency %lld%s; MTP %s\n",
                      static_cast<long long>(w.input_len), static_cast<long long>(w.output_len),
                      static_cast<long long>(w.concurrency),
                      w.request_rate > 0 ? fmt::format(", {:.3g} requests/s", w.request_rate).c_str() : "",
                      w.mtp_k > 0 ? fmt::format("k {} at acceptance {:.2f} ({:.3f} tokens/step)", w.mtp_k,
                                                w.mtp_acceptance, p.mtp_tokens_per_step)
                                        .c_str()
                                  : "off");
  const auto& s = p.decode.step;
  out += fmt::sprintf("\ndecode: %.3f tokens/s per user, %.1f in total (TPOT %s; batch %.0f per replica)\n",
                      p.decode.tokens_per_s_per_user, p.decode.tokens_per_s_total, ms(p.decode.tpot).c_str(),
                      p.decode.batch_per_replica);
  out += fmt::sprintf("  step %s = max(weight reads %s + KV reads %s, compute %s) + collectives %s + MTP draft %s\n",
                      ms(s.total).c_str(), ms(s.weight_reads).c_str(), ms(s.kv_reads).c_str(), ms(s.compute).c_str(),
                      ms(s.collectives).c_str(), ms(s.mtp_draft).c_str());
  out += fmt::sprintf(
      "  %s-bound; %lld collectives per step; %.1f routed experts read per MoE layer; %s weights + %s KV "
      "read per GPU\n",
      s.compute_bound ? "compute" : "memory", static_cast<long long>(s.collectives_per_step), s.experts_read_per_layer,
      gb(s.weight_bytes_per_gpu).c_str(), gb(s.kv_bytes_per_gpu).c_str());
  out += fmt::sprintf("  single-stream ceiling of one GPU (bandwidth / activated bytes): %.2f tokens/s\n",
                      p.single_stream_ceiling_tokens_per_s);
  out += fmt::sprintf("\nttft: %s = queueing %s + prefill compute %s + KV transfer %s\n", ms(p.ttft.total).c_str(),
                      ms(p.ttft.queueing).c_str(), ms(p.ttft.prefill_compute).c_str(), ms(p.ttft.kv_transfer).c_str());
  out +=
      fmt::sprintf("  %.3g requests/s into prefill, utilization %.2f per replica%s\n", p.ttft.arrival_rate,
                   p.ttft.prefill_utilization, p.ttft.saturated ? " (SATURATED: the queue grows without bound)" : "");
  out += fmt::sprintf("\nkv: %.0f bytes per token; %.0f per request (%s); %.0f sent prefill -> decode per request\n",
                      p.kv_bytes_per_token, p.kv_bytes_per_request, gb(p.kv_bytes_per_request).c_str(),
                      p.kv_transfer_bytes_per_request);
  out +=
      fmt::sprintf("memory per decode GPU: weights %s + KV %s of %s usable: %s (room for %lld requests per replica)\n",
                   gb(p.memory.weight_bytes_per_gpu).c_str(), gb(p.memory.kv_bytes_per_gpu).c_str(),
                   gb(p.memory.usable_bytes_per_gpu).c_str(), p.memory.fits ? "fits" : "DOES NOT FIT",
                   static_cast<long long>(p.memory.max_batch_per_replica));
  out += fmt::sprintf("\nprefill:decode pools for TTFT <= %.0f ms and TPOT <= %.1f ms at concurrency %lld:\n",
                      in.slo.ttft * 1e3, in.slo.tpot * 1e3, static_cast<long long>(w.concurrency));
  if (p.pools.feasible) {
    out += fmt::sprintf(
        "  %lld prefill x tp %lld (%lld GPUs) : %lld decode x tp %lld (%lld GPUs) = prefill:decode %.3g, "
        "%lld GPUs; TTFT %s, TPOT %s\n",
        static_cast<long long>(p.pools.prefill_replicas), static_cast<long long>(in.prefill.tp),
        static_cast<long long>(p.pools.prefill_gpus), static_cast<long long>(p.pools.decode_replicas),
        static_cast<long long>(in.decode.tp), static_cast<long long>(p.pools.decode_gpus), p.pools.ratio,
        static_cast<long long>(p.pools.prefill_gpus) + static_cast<long long>(p.pools.decode_gpus),
        ms(p.pools.ttft).c_str(), ms(p.pools.tpot).c_str());
  } else {
    out += fmt::sprintf("  infeasible: %s\n", p.pools.reason.c_str());
  }
  return out;
}

Result<void> runPlan(const PlanFlags& flags) {
  PD_ASSIGN_OR_RETURN(const PlanInput input, planInputFromFlags(flags, nullptr));
  PD_ASSIGN_OR_RETURN(const Prediction prediction, predict(input));
  const std::string report = flags.json ? planReportJson(input, prediction) + "\n" : planReportText(input, prediction);
  std::fputs(report.c_str(), stdout);
  std::fflush(stdout);
  return okStatus();
}

namespace {

// A GPU run's ceilings against the hardware profile, and the decode predictions under each.
Result<void> reportGpuCeilings(const PlanFlags& flags, const CalibrationFile& bench) {
  PD_ASSIGN_OR_RETURN(const PlanInput profile, planInputFromFlags(flags, nullptr));
  PD_ASSIGN_OR_RETURN(const PlanInput measured, planInputFromFlags(flags, &bench));
  struct Ceiling {
    const char* name;
    double profile;
    double measured;  // < 0: not in the file
  };
  const Ceiling ceilings[] = {
      {"hbm_read_gbs", profile.hardware.hbm_bandwidth / 1e9, bench.read_bandwidth_gbs},
      {"dense_bf16_tflops", profile.hardware.bf16_flops / 1e12, bench.gemm_bf16_tflops},
  };
  constexpr std::int64_t kConcurrency[] = {1, 16, 64};
  if (flags.json) {
    std::string rows;
    for (const Ceiling& c : ceilings) {
      JsonObject r;
      r.str("ceiling", c.name).num("profile", c.profile);
      if (c.measured > 0) r.num("measured", c.measured).num("ratio", c.measured / c.profile);
      rows += (rows.empty() ? "" : ", ") + r.text();
    }
    std::string decode;
    for (const std::int64_t n : kConcurrency) {
      JsonObject r;
      const double p = predictDecode(profile, n, 1).tokens_per_s_total;
      const double m = predictDecode(measured, n, 1).tokens_per_s_total;
      r.integer("concurrency", n)
          .num("profile_tokens_per_s", p)
          .num("measured_ceilings_tokens_per_s", m)
          .num("ratio", m / p);
      decode += (decode.empty() ? "" : ", ") + r.text();
    }
    JsonObject out;
    out.str("model", profile.model.name)
        .str("hardware", profile.hardware.name)
        .str("device", bench.device)
        .str("note", bench.note)
        .str("fitted", "none: the file has no decode levels")
        .raw("ceilings", "[" + rows + "]")
        .raw("decode", "[" + decode + "]");
    std::puts(out.text().c_str());
    return okStatus();
  }
  std::fputs(planHeader(profile).c_str(), stdout);
  if (!bench.note.empty()) std::printf("file note: %s\n", bench.note.c_str());
  std::printf("GPU run on %s (bench engine --device cuda) against the %s profile\n\n",
              bench.device.empty() ? "an unnamed device" : bench.device.c_str(), profile.hardware.name.c_str());
  std::printf("| ceiling | profile | measured | measured / profile |\n| --- | --- | --- | --- |\n");
  for (const Ceiling& c : ceilings) {
    if (c.measured > 0) {
      std::printf("| %s | %.1f | %.1f | %.3f |\n", c.name, c.profile, c.measured, c.measured / c.profile);
    } else {
      std::printf("| %s | %.1f | not measured | - |\n", c.name, c.profile);
    }
  }
  std::printf(
      "\n| concurrency | predicted tok/s (profile) | predicted tok/s (measured ceilings) | ratio |\n"
      "| --- | --- | --- | --- |\n");
  for (const std::int64_t n : kConcurrency) {
    const double p = predictDecode(profile, n, 1).tokens_per_s_total;
    const double m = predictDecode(measured, n, 1).tokens_per_s_total;
    std::printf("| %lld | %.1f | %.1f | %.3f |\n", static_cast<long long>(n), p, m, m / p);
  }
  std::printf("\nfitted: none (the file has no decode levels: the device engine's decode has not run)\n");
  return okStatus();
}

}  // namespace

Result<void> runCalibration(const PlanFlags& flags) {
  auto bench = readCalibrationFile(flags.calibrate);
  if (!bench.ok()) return bench.error();
  if (bench->points.empty()) return reportGpuCeilings(flags, *bench);
  auto input = planInputFromFlags(flags, &bench.value());
  if (!input.ok()) return input.error();
  auto fit = calibrate(input.value(), bench->points);
  if (!fit.ok()) return fit.error();
  const auto& h = fit->hardware;
  const auto& points = bench->points;
  if (flags.json) {
    std::string rows;
    for (std::size_t i = 0; i < points.size(); ++i) {
      JsonObject r;
      r.integer("concurrency", points[i].concurrency)
          .num("measured_tokens_per_s", points[i].tokens_per_s_total)
          .num("predicted_tokens_per_s", fit->predicted_tokens_per_s_total[i])
          .num("ratio", fit->predicted_tokens_per_s_total[i] / points[i].tokens_per_s_total);
      if (points[i].net_latency >= 0) r.num("net_latency_ms", points[i].net_latency * 1e3);
      rows += (rows.empty() ? "" : ", ") + r.text();
    }
    JsonObject out;
    out.str("model", input->model.name)
        .str("fitted", fit->fitted)
        .obj("hardware", hardwareJson(h))
        .raw("points", "[" + rows + "]")
        .num("rms_relative_error", fit->rms_relative_error);
    std::puts(out.text().c_str());
    return okStatus();
  }
  PlanInput fitted = input.value();
  fitted.hardware = h;
  std::fputs(planHeader(fitted).c_str(), stdout);
  std::printf("fitted: %s\n\n", fit->fitted.c_str());
  std::printf("| concurrency | network ms | measured tok/s | predicted tok/s | predicted / measured |\n");
  std::printf("| --- | --- | --- | --- | --- |\n");
  for (std::size_t i = 0; i < points.size(); ++i) {
    const double lat = points[i].net_latency >= 0 ? points[i].net_latency : h.net_latency;
    std::printf("| %lld | %.3f | %.3f | %.3f | %.3f |\n", static_cast<long long>(points[i].concurrency), lat * 1e3,
                points[i].tokens_per_s_total, fit->predicted_tokens_per_s_total[i],
                fit->predicted_tokens_per_s_total[i] / points[i].tokens_per_s_total);
  }
  std::printf("\nrms relative error %.2f %%\n", fit->rms_relative_error * 100);
  std::printf(
      "reuse: --memory-efficiency %.4g --compute-efficiency %.4g --net-collective-overhead-us %.4g "
      "--net-latency-hops %.4g\n",
      h.memory_efficiency, h.compute_efficiency, h.net_collective_overhead * 1e6, h.net_latency_hops);
  return okStatus();
}

}  // namespace pd::plan
