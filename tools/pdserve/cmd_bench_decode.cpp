// pdserve bench decode: the decode worker's engine on the CPU engine, step time and MBU per batch
// size, MTP speedup against the ideal for the measured acceptance (tools/bench/decode).
#include <string>
#include <vector>

#include "bench/common/bench_util.h"
#include "bench/decode/decode_bench.h"
#include "cli.h"

namespace pd::cli {

int runBenchDecode(const std::vector<std::string>& args) {
  CommonConfig common;
  CommonOptions common_sets(common);
  bench::DecodeBenchConfig cfg;
  std::string batches_text = "1,4,16,64";
  std::string ks_text = "1";
  config::OptionSet set("bench_decode");
  set.add("model", &cfg.model,
          "model folder; 'default': the embedded default model; empty: a make-model checkpoint of --preset "
          "generated into a temp folder")
      .add("preset", &cfg.preset, "make-model preset of the generated model (weights should be >= 8x the L3 cache)")
      .add("threads", &cfg.threads, "compute threads (0: every hardware thread)", 0, 1024)
      .add("batches", &batches_text, "decode batch sizes, comma-separated")
      .add("context", &cfg.context, "cached prompt tokens per sequence", 1, 1 << 20)
      .add("steps", &cfg.steps, "timed decode steps per batch size (after 2 warm-up steps)", 1, 10000)
      .add("kv_dtype", &cfg.kv_dtype, "latent KV pool element type", {"bf16", "f32", "fp8"})
      .add("mtp_k", &ks_text, "MTP draft counts to measure, comma-separated (batch 1)")
      .add("mtp_tokens", &cfg.mtp_tokens, "tokens per MTP run at batch 1 (the first 2 steps are warm-up)", 8, 100000)
      .add("bandwidth_mb", &cfg.bandwidth_mb, "buffer size of the read-bandwidth probe in MiB", 64, 1 << 20)
      .add("tracing", &cfg.tracing,
           "time the step with the decode worker's span work at trace sample ratio 1.0 against without it")
      .add("json", &cfg.json, "print one JSON object instead of text")
      .add("schema", &cfg.schema,
           "a JSON Schema: each batch size also runs constrained to it, after a plain run, and prints the step-time "
           "ratio (the value must not end within the run; needs a model whose vocabulary fits the tokenizer)");
  auto loaded = loadCommandOptions(
      "usage: pdserve bench decode [--model DIR | --preset bench] [--batches 1,4,16,64] [--mtp-k 1] [--json]\n"
      "Decode step time, tokens/s and memory-bandwidth utilization (MBU) per batch size through the decode\n"
      "worker's engine (scheduler + paged KV), and MTP speedup over the ideal for the measured acceptance, with a\n"
      "bench-only draft override proposing the greedy continuation with probability p.",
      {&set, &common_sets.log, &common_sets.model}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  auto batches = bench::parsePositiveList(batches_text, "--batches");
  if (!batches.ok()) return reportFailure(batches.error());
  auto ks = bench::parsePositiveList(ks_text, "--mtp-k");
  if (!ks.ok()) return reportFailure(ks.error());
  cfg.batches = std::move(*batches);
  cfg.mtp_ks = std::move(*ks);
  cfg.cache_dir = common.cache_dir;
  cfg.batch_invariant = common.batch_invariant;
  cfg.tokenizer = common.tokenizer_path;
  auto done = bench::runDecodeBench(cfg);
  return done.ok() ? 0 : reportFailure(done.error());
}

}  // namespace pd::cli
