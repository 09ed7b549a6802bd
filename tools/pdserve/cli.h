#pragma once
/// Shared plumbing of the pdserve subcommands: the option sections every command may read
/// (log, model), and the YAML/env/flag loading around them.
/// Thread rules: main thread only.

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/config.h"
#include "pd/common/result.h"
#include "pd/common/stop_signals.h"
#include "pd/trace/trace_config.h"

namespace pd::cli {

/// Settings every role shares (sections `log:` and `model:`).
struct CommonConfig {
  std::string log_level = "info";
  std::string log_format = "text";  ///< "text" or "json" (one JSON object per line)
  /// Model folder; empty means the embedded default model (created on first use).
  std::filesystem::path model_path;
  /// Tokenizer folder (tokenizer.json + tokenizer_config.json); empty: the model folder's, or
  /// for the default model the fetched DeepSeek-V3 tokenizer in the cache folder.
  std::filesystem::path tokenizer_path;
  /// Where the model runs: "cpu" (default), "cuda" or "cuda:N" (pd/engine/gpu.h ModelDevice).
  std::string model_device = "cpu";
  /// Batch-invariant numerics (docs/engine.md, "Batch-invariant mode"): a request's tokens do not
  /// depend on what it is batched, chunked or resumed with. Slower; CPU engine only.
  bool batch_invariant = false;
  /// With model.device cuda: "fp32" (the parity mode) or "bf16" (BF16 linears as stored, FP32
  /// accumulation); gpu::Numerics, docs/gpu.md "Numerics modes".
  std::string model_numerics = "fp32";
  /// With model.device cuda: decode steps replay CUDA graphs captured per shape (docs/gpu.md,
  /// "CUDA graphs"); false runs every step eagerly.
  bool cuda_graphs = true;
  /// With model.device cuda: the fraction of the device's total memory the process may use (vLLM's
  /// --gpu-memory-utilization); the KV pool gets what is left after weights, workspace and CUDA
  /// graphs (docs/gpu.md, "The GPU memory plan"). In (0, 1].
  double gpu_memory_utilization = 0.9;
  /// The device KV cache's element type: "bf16" or "fp8" (e4m3 with per-block scales; no kernel
  /// uses it yet).
  std::string kv_cache_dtype = "bf16";
  /// Where the embedded default model and the fetched tokenizer live.
  std::filesystem::path cache_dir = config::defaultCacheDir();
  /// The cluster secret file (section `cluster:`, docs/security.md); empty: the internal plane is
  /// unauthenticated.
  std::filesystem::path cluster_secret_file;
  /// Tracing (section `trace:`, docs/observability.md).
  trace::TraceConfig trace;
};

/// The `log:`, `model:`, `cluster:` and `trace:` sections, bound to `cfg`.
struct CommonOptions {
  explicit CommonOptions(CommonConfig& cfg);
  config::OptionSet log{"log"};
  config::OptionSet model{"model"};
  config::OptionSet cluster{"cluster"};
  config::OptionSet trace{"trace"};
};

/// Removes `--check-config` (or `--check_config`) from `args`; true when it was there. The role
/// commands then validate their configuration and exit without loading the model.
bool takeCheckConfigFlag(std::vector<std::string>& args);

// The roles' stop signals (pd/common/stop_signals.h), by their short names in the commands.
using proc::blockStopSignals;
using proc::DrainEnd;
using proc::waitForDrain;
using proc::waitForSignalWatching;

/// Prints "PDSERVE_READY <fields>" on stdout and flushes it: the line a supervisor waits for
/// (pd/common/role_process.h).
void printReadyLine(const std::string& fields);

/// Prints "pdserve: error: ..." to stderr; returns 2 for bad input, 1 otherwise.
int reportFailure(const Error& error);

/// Loads a subcommand's options: the YAML file (--config) is validated against every role's
/// sections, and applied, with env and flags, to the `active` sections. On --help prints
/// `usage` and the option tables. Applies log.level when `common` is given.
Result<config::LoadOutput> loadCommandOptions(const std::string& usage, const std::vector<config::OptionSet*>& active,
                                              const std::vector<std::string>& args,
                                              const CommonConfig* common = nullptr);

/// The model folder to use: `cfg.model_path`, or the embedded default model (created in the
/// cache folder on first use from the fetched tokenizer).
Result<std::filesystem::path> resolveModelDir(const CommonConfig& cfg);

/// model.device parsed and checked (pd/engine/gpu.h checkModelDevice) by every command that
/// runs the model, before it loads anything: a CUDA device that is not there is a clear error.
/// The router, which never runs the model, does not check it.
Status checkModelDevice(const CommonConfig& cfg);

/// model.gpu_memory_utilization in (0, 1] (the option table accepts 0..1), and model.numerics
/// other than fp32 only with model.device cuda; InvalidArgument.
Status checkGpuOptions(const CommonConfig& cfg);

int runUp(const std::vector<std::string>& args);
/// The three server roles (cmd_router.cpp, cmd_prefill.cpp, cmd_decode.cpp).
int runRouter(const std::vector<std::string>& args);
int runPrefill(const std::vector<std::string>& args);
int runDecode(const std::vector<std::string>& args);
int runInspect(const std::vector<std::string>& args);
int runMakeModel(const std::vector<std::string>& args);
/// JSONL filters over the tokenizer and chat template (cmd_tokenize.cpp).
int runTokenize(const std::vector<std::string>& args);
int runDetokenize(const std::vector<std::string>& args);
int runChatTemplate(const std::vector<std::string>& args);
/// pdserve bench kv: KV transfer between two processes vs ucx_perftest (cmd_bench_kv.cpp).
int runBenchKv(const std::vector<std::string>& args);
/// pdserve logits / generate: the model engine in one process (cmd_model.cpp).
int runLogits(const std::vector<std::string>& args);
int runGenerate(const std::vector<std::string>& args);
/// pdserve bench engine: decode MBU and prefill FLOP utilization (cmd_bench_engine.cpp).
int runBenchEngine(const std::vector<std::string>& args);
/// pdserve bench prefill: TTFT of compute alone, streaming and send-after (cmd_bench_prefill.cpp).
int runBenchPrefill(const std::vector<std::string>& args);
/// pdserve plan: the capacity planner of tools/plan (cmd_plan.cpp).
int runPlan(const std::vector<std::string>& args);
/// pdserve bench router: the router's added latency, p50/p99 (cmd_bench_router.cpp).
int runBenchRouter(const std::vector<std::string>& args);
/// pdserve bench comm: tensor-parallel allreduce latency vs ucx_perftest (cmd_bench_comm.cpp).
int runBenchComm(const std::vector<std::string>& args);
/// pdserve bench decode: DecodeEngine step time, MBU per batch size, MTP speedup vs ideal
/// (cmd_bench_decode.cpp).
int runBenchDecode(const std::vector<std::string>& args);
/// pdserve bench serve: the OpenAI-API load generator of tools/bench/serve (cmd_bench_serve.cpp).
int runBenchServe(const std::vector<std::string>& args);
/// pdserve trace: one request's spans from a trace file as a table (cmd_trace.cpp).
int runTrace(const std::vector<std::string>& args);

}  // namespace pd::cli
