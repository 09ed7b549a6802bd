// pdserve bench prefill: TTFT of compute alone, streaming and send-after (tools/bench/prefill).
// The decode side is this binary in a hidden receiver mode (`pdserve bench prefill --receiver
// --lengths <every transfer's length, in order>`).
#include <cstdio>
#include <string>
#include <vector>

#include "bench/prefill/prefill_bench.h"
#include "cli.h"
#include "pd/common/subprocess.h"
#include "pd/engine/model_config.h"

namespace pd::cli {

int runBenchPrefill(const std::vector<std::string>& args) {
  CommonConfig common;
  CommonOptions common_sets(common);
  bench::PrefillBenchConfig cfg;
  std::string lengths;
  bool json = false;
  bool receiver = false;
  config::OptionSet set("bench_prefill");
  config::OptionSet kv_set("kvtransfer");
  kvtransfer::registerOptions(kv_set, cfg.kvtransfer);
  set.add("model", &cfg.model, "model folder; empty: model.path, or the embedded default model")
      .add("lengths", &lengths,
           "comma-separated prompt lengths in tokens; empty: 512,2048,8192 cut at the model's context (which is "
           "measured in place of the lengths cut)")
      .add("runs", &cfg.runs, "runs per length and mode (the median is reported)", 1, 1000)
      .add("threads", &cfg.threads, "compute threads (0: every hardware thread)", 0, 1024)
      .add("chunk_size", &cfg.chunk_size, "prefill chunk size", 1, 1 << 20)
      .add("kv_dtype", &cfg.kv_dtype, "the decode pool's KV dtype", {"bf16", "f32", "fp8"})
      .add("json", &json, "print one JSON object instead of the table")
      .add("receiver", &receiver, "internal: run as the decode process");
  auto loaded = loadCommandOptions(
      "usage: pdserve bench prefill [--model DIR] [--lengths 512,2048,8192] [--runs 3] [--json]\n"
      "TTFT of the prefill engine: compute alone, compute + layer-wise streaming to a decode process, and\n"
      "compute then send-after, interleaved in one run. streaming_overhead = streaming / compute alone - 1 at\n"
      "2048 tokens (or the nearest length).",
      {&set, &kv_set, &common_sets.log, &common_sets.model}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  std::vector<std::int64_t> requested;
  if (!lengths.empty()) {
    auto parsed = bench::parsePrefillLengths(lengths);
    if (!parsed.ok()) return reportFailure(parsed.error());
    requested = std::move(*parsed);
  }
  if (cfg.model.empty()) {
    auto dir = resolveModelDir(common);
    if (!dir.ok()) return reportFailure(dir.error());
    cfg.model = *dir;
  }
  if (receiver) {
    const Status s = bench::runPrefillReceiver(cfg.model, cfg.kvtransfer, cfg.kv_dtype, requested);
    return reportFailure(s.ok() ? makeError(ErrorCode::Internal, "receiver returned") : s.error());
  }
  auto model_config = ModelConfig::load(cfg.model);
  if (!model_config.ok()) return reportFailure(model_config.error());
  auto fitted = bench::fitPrefillLengths(requested, model_config->max_position_embeddings);
  if (!fitted.ok()) return reportFailure(fitted.error());
  cfg.lengths = std::move(*fitted);

  auto self = proc::selfExecutable();
  if (!self.ok()) return reportFailure(self.error());
  cfg.receiver_argv = {*self,
                       "bench",
                       "prefill",
                       "--receiver",
                       "--model",
                       cfg.model.string(),
                       "--kv-dtype",
                       cfg.kv_dtype,
                       "--kvtransfer.ucx_tls",
                       cfg.kvtransfer.ucx_tls,
                       "--kvtransfer.data_path",
                       cfg.kvtransfer.data_path,
                       "--log.level",
                       "warn"};
  cfg.batch_invariant = common.batch_invariant;
  auto result = bench::runPrefillBench(cfg);
  if (!result.ok()) return reportFailure(result.error());
  const std::string report = json ? bench::prefillReportJson(cfg, *result) + "\n" : bench::prefillReportTable(*result);
  std::fputs(report.c_str(), stdout);
  return 0;
}

}  // namespace pd::cli
