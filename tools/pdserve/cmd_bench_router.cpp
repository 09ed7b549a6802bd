// pdserve bench router: what the router adds to a request's latency, through the router minus
// straight to the workers, p50/p99 per concurrency; optionally the router's thread count with
// many streams held open (tools/bench/router).
#include <string>
#include <vector>

#include "bench/router/router_bench.h"
#include "cli.h"
#include "pd/common/subprocess.h"

namespace pd::cli {

int runBenchRouter(const std::vector<std::string>& args) {
  CommonConfig common;
  bench::RouterBenchConfig cfg;
  std::string concurrency = "1,64";
  CommonOptions common_sets(common);
  config::OptionSet set("bench_router");
  set.add("concurrency", &concurrency, "comma-separated concurrency levels")
      .add("requests", &cfg.requests, "timed requests per way and level", 1, 1000000)
      .add("warmup", &cfg.warmup, "untimed requests per way before each level", 0, 100000)
      .add("prompt_tokens", &cfg.prompt_tokens, "prompt length in tokens", 1, 4096)
      .add("hold_streams", &cfg.hold_streams, "streaming requests to hold open at once for the thread count (0 = skip)",
           0, 100000)
      .add("io_threads", &cfg.io_threads, "the router's I/O threads", 1, 256)
      .add("tracing", &cfg.tracing,
           "also time a second router with tracing at sample ratio 1.0 (spans to a temp file) and print the ratios")
      .add("json", &cfg.json, "print one JSON object instead of text");
  auto loaded = loadCommandOptions(
      "usage: pdserve bench router [--model.path DIR] [--concurrency 1,64] [--requests N] [--json]\n"
      "Latency of one-token completions through the router minus the same requests sent straight to the\n"
      "workers' internal API, p50 and p99 (starts its own decode, prefill and router processes).",
      {&common_sets.log, &common_sets.model, &set}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  auto levels = bench::parseConcurrencyLevels(concurrency);
  if (!levels.ok()) return reportFailure(levels.error());
  cfg.concurrency = std::move(*levels);
  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  auto exe = proc::selfExecutable();
  if (!exe.ok()) return reportFailure(exe.error());
  cfg.model = *model_dir;
  cfg.executable = *exe;
  cfg.tokenizer = common.tokenizer_path;
  auto done = bench::runRouterBench(cfg);
  return done.ok() ? 0 : reportFailure(done.error());
}

}  // namespace pd::cli
