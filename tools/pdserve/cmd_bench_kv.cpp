// pdserve bench kv: KV transfer between two processes against ucx_perftest's put bandwidth
// (tools/bench/kv).
#include <cstdio>
#include <string>
#include <vector>

#include "bench/kv/kv_bench.h"
#include "cli.h"
#include "pd/common/log.h"

namespace pd::cli {

int runBenchKv(const std::vector<std::string>& args) {
  CommonConfig common;
  CommonOptions common_sets(common);
  bench::KvBenchConfig cfg;
  std::string tokens = "1024,4096";
  bool json = false;
  config::OptionSet set("bench");
  set.add("tokens", &tokens, "prompt lengths to time, comma-separated")
      .add("runs", &cfg.runs, "timed runs per case (medians are reported; use at least 5)", 1, 1000)
      .add("layers", &cfg.layers, "KV layers per token", 1, 4096)
      .add("block_size", &cfg.block_size, "tokens per KV block (one put moves one block of one layer)", 1, 4096)
      .add("kv_dim", &cfg.kv_dim, "latent KV values per token per layer (kv_lora_rank + qk_rope_head_dim)", 1, 65536)
      .add("json", &json, "print one JSON object instead of the table")
      .add("perftest", &cfg.perftest, "ucx_perftest binary for the ceiling; empty skips it");
  config::OptionSet kv_set("kvtransfer");
  kvtransfer::registerOptions(kv_set, cfg.kvtransfer);
  auto loaded = loadCommandOptions(
      "usage: pdserve bench kv [--tokens 1024,4096] [--runs 7] [--json] [--kvtransfer.ucx_tls tcp,sm]\n"
      "Moves the BF16 latent KV of prompts (61 layers x block 64 x 576 values by default) between two\n"
      "processes and compares it with ucx_perftest ucp_put_bw on the same UCX_TLS and message size.",
      {&common_sets.log, &set, &kv_set}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(makeError(ErrorCode::InvalidArgument, "bench kv takes no positional arguments"));
  }
  auto token_cases = bench::parseKvTokenList(tokens);
  if (!token_cases.ok()) return reportFailure(token_cases.error());
  cfg.tokens = std::move(*token_cases);
  if (cfg.runs < 5) log::warn("bench", "fewer than 5 runs per case: medians will be noisy");
  auto result = bench::runKvBench(cfg);
  if (!result.ok()) return reportFailure(result.error());
  const std::string report = json ? bench::kvReportJson(cfg, *result) + "\n" : bench::kvReportText(cfg, *result);
  std::fputs(report.c_str(), stdout);
  return 0;
}

}  // namespace pd::cli
