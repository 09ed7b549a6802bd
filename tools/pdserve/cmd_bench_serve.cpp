// pdserve bench serve: the OpenAI-API load generator (docs/benchmarks.md, "bench serve";
// tools/bench/serve): flags into a ServeBenchConfig, then the sweep.
#include <string>
#include <vector>

#include "bench/serve/bench_serve.h"
#include "cli.h"

namespace pd::cli {
namespace {

// `--json` and `--markdown` take an optional file: bare, they mean stdout.
std::vector<std::string> withOptionalValues(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    const bool bare = a == "--json" || a == "--markdown" || a == "--bench_serve.json" || a == "--bench_serve.markdown";
    if (bare && (i + 1 == args.size() || args[i + 1].starts_with("--"))) {
      out.push_back(a + "=-");
    } else {
      out.push_back(a);
    }
  }
  return out;
}

}  // namespace

int runBenchServe(const std::vector<std::string>& args) {
  CommonConfig common;
  bench::ServeBenchConfig cfg;
  CommonOptions common_sets(common);
  config::OptionSet set("bench_serve");
  set.add("url", &cfg.url, "the server: http://host:port[/prefix] (pdserve's router, vLLM, SGLang, ...)")
      .add("model", &cfg.model, "model name sent in requests; empty: the first of GET /v1/models")
      .add("endpoint", &cfg.endpoint, "API to load", {"completions", "chat"})
      .add("api_key", &cfg.api_key, "sent as Authorization: Bearer KEY (env PDSERVE_BENCH_SERVE_API_KEY)")
      .add("input_tokens", &cfg.input_tokens, "random prompts: tokens (completions) or words (chat) per prompt", 1,
           1 << 20)
      .add("output_tokens", &cfg.output_tokens,
           "max_tokens of each request (random prompts, and JSONL lines without one)", 1, 1 << 20)
      .add("prompts", &cfg.prompts,
           "JSONL file of {\"prompt\": ...} or {\"messages\": [...]} lines instead of random ones")
      .add("concurrency", &cfg.concurrency, "closed-loop levels: comma-separated concurrent requests")
      .add("request_rate", &cfg.request_rate, "open-loop levels instead: comma-separated Poisson request rates (req/s)")
      .add("max_concurrency", &cfg.max_concurrency, "request-rate mode: most requests in flight", 1, 4096)
      .add("num_prompts", &cfg.num_prompts,
           "timed requests per level; 0: max(16, 4 x concurrency), or max(16, 20 s of arrivals) for rates", 0, 10000000)
      .add("warmup", &cfg.warmup, "untimed requests before each level; -1: one per concurrent request (rates: 4)", -1,
           1000000)
      .add("seed", &cfg.seed, "seed of the prompts and arrival times", 0, INT64_MAX)
      .add("ignore_eos", &cfg.ignore_eos,
           "ask the server to generate all max_tokens (servers without it may stop early)")
      .add("return_token_ids", &cfg.return_token_ids,
           "ask for token ids per chunk, to count multi-token (MTP) chunks per token")
      .add("temperature", &cfg.temperature, "sampling temperature", 0, 2)
      .add("token_id_min", &cfg.token_id_min, "random prompts: smallest token id", 0, INT32_MAX)
      .add("token_id_max", &cfg.token_id_max,
           "random prompts: token ids are below this; 0: the served vocabulary (/v1/models' vocab_size, else "
           "model.path's, else the embedded default model's)",
           0, INT32_MAX)
      .add("slo_ttft_ms", &cfg.slo_ttft_ms, "goodput SLO on TTFT (0: none)", 0, 1e9)
      .add("slo_tpot_ms", &cfg.slo_tpot_ms, "goodput SLO on TPOT (0: none)", 0, 1e9)
      .add("slo_e2e_ms", &cfg.slo_e2e_ms, "goodput SLO on end-to-end latency (0: none)", 0, 1e9)
      .add("metrics_url", &cfg.metrics_url,
           "Prometheus pages: decode workers' (MTP acceptance) and prefill workers' (prefill and KV transfer time per "
           "prompt); empty: try --url's /metrics. "
           "multiturn: the prefill workers' pages of --url's cluster (KV bytes put per later turn)")
      .add("baseline_metrics_url", &cfg.baseline_metrics_url,
           "multiturn: the prefill workers' pages of --baseline_url's cluster (transfer_bytes_ratio)")
      .add("timeout_s", &cfg.timeout_s, "deadline of each request", 1, 86400)
      .add("json", &cfg.json, "write the JSON report to FILE; bare --json or '-': stdout")
      .add("markdown", &cfg.markdown,
           "write the markdown table to FILE ('-': stdout; default: stdout unless --json is)")
      .add("svg", &cfg.svg, "write an SVG chart (TTFT vs throughput, tokens/s vs concurrency)")
      .add("net_latency_ms", &cfg.net_latency_ms, "recorded in the JSON for pdserve plan --calibrate (-1: not given)",
           -1, 1e6)
      .add("quiet", &cfg.quiet, "no progress bar or per-level lines on stderr")
      .add("workload", &cfg.workload,
           "random: the sweep; multiturn / shared-prefix: prefix-reuse workloads at the first --concurrency "
           "(docs/benchmarks.md, \"Prefix reuse\")",
           {"random", "multiturn", "shared-prefix"})
      .add("baseline_url", &cfg.baseline_url,
           "prefix-reuse workloads: a second server run right after --url (e.g. round_robin, prefix cache off); "
           "multiturn_ttft_ratio compares the two")
      .add("conversations", &cfg.conversations, "multiturn: conversations (N)", 1, 1 << 20)
      .add("turns", &cfg.turns, "multiturn: turns per conversation (T)", 1, 1024)
      .add("system_tokens", &cfg.system_tokens, "multiturn: tokens of the system prompt every conversation shares", 0,
           1 << 20)
      .add("turn_tokens", &cfg.turn_tokens, "multiturn: new user tokens per turn", 1, 1 << 20)
      .add("prefixes", &cfg.prefixes, "shared-prefix: distinct long prefixes (K)", 1, 1 << 20)
      .add("prefix_tokens", &cfg.prefix_tokens, "shared-prefix: tokens per prefix", 1, 1 << 20)
      .add("suffix_tokens", &cfg.suffix_tokens, "shared-prefix: tokens per suffix", 0, 1 << 20)
      .add("requests_per_prefix", &cfg.requests_per_prefix, "shared-prefix: requests per prefix", 1, 1 << 20);
  auto loaded = loadCommandOptions(
      "usage: pdserve bench serve [--url http://127.0.0.1:8000] [--model NAME] [--endpoint completions|chat]\n"
      "                           [--input-tokens N --output-tokens N | --prompts FILE.jsonl]\n"
      "                           [--concurrency 1,2,4,... | --request-rate R1,R2,...] [--json [FILE]]\n"
      "                           [--markdown FILE] [--svg FILE] [--slo-ttft-ms MS] [--slo-tpot-ms MS]\n"
      "Load-tests an OpenAI-compatible server with streaming requests and reports TTFT, TPOT, ITL and\n"
      "end-to-end latency (mean, p50, p90, p99), tokens/s, requests/s and goodput per level\n"
      "(definitions as vLLM's benchmark_serving.py; docs/benchmarks.md).",
      {&common_sets.log, &common_sets.model, &set}, withOptionalValues(args), &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(makeError(ErrorCode::InvalidArgument, "unexpected argument '" + loaded->positionals[0] + "'"));
  }
  auto done = bench::runServeBench(cfg, [&common] { return resolveModelDir(common); });
  return done.ok() ? 0 : reportFailure(done.error());
}

}  // namespace pd::cli
