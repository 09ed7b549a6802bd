// pdserve bench serve: the OpenAI-API load generator (docs/benchmarks.md, "bench serve").
//
// Sends streaming /v1/completions or /v1/chat/completions requests to pdserve's router or any
// OpenAI-compatible server (vLLM, SGLang) at a sweep of fixed concurrencies or Poisson request
// rates, and reports per level TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99),
// throughputs, goodput under SLOs, failures, and MTP acceptance from the servers' /metrics.
// The work is in tools/bench_serve; this file is flags, the progress display and the outputs.

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>

#include "bench/serve/progress_display.h"
#include "bench/serve/report.h"
#include "bench/serve/runner.h"
#include "bench/serve/server_metrics.h"
#include "bench/serve/stats.h"
#include "bench/serve/workload.h"
#include "cli.h"
#include "pd/common/http_client.h"
#include "pd/common/log.h"
#include "pd/engine/model_config.h"

namespace pd::cli {
namespace {

using namespace std::chrono_literals;

struct BenchServeConfig {
  std::string url = "http://127.0.0.1:8000";
  std::string model;  ///< empty: the first of GET /v1/models
  std::string endpoint = "completions";
  std::string api_key;
  std::int64_t input_tokens = 128;
  std::int64_t output_tokens = 128;
  std::filesystem::path prompts;
  std::string concurrency = "1,2,4,8,16,32,64,128";
  std::string request_rate;
  std::int64_t max_concurrency = 256;
  std::int64_t num_prompts = 0;
  std::int64_t warmup = -1;
  std::int64_t seed = 0;
  bool ignore_eos = true;
  bool return_token_ids = true;
  double temperature = 0;
  std::int64_t token_id_min = 100;
  std::int64_t token_id_max = 0;  ///< 0: the served vocabulary
  double slo_ttft_ms = 0;
  double slo_tpot_ms = 0;
  double slo_e2e_ms = 0;
  std::vector<std::string> metrics_url;
  std::int64_t timeout_s = 600;
  std::string json;
  std::string markdown;
  std::filesystem::path svg;
  double net_latency_ms = -1;
  bool quiet = false;
};

std::string utcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

Status writeText(const std::string& where, const std::string& text) {
  if (where == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return okStatus();
  }
  std::ofstream out(where, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return makeError(ErrorCode::Io, "cannot write " + where);
  return okStatus();
}

// The vocabulary random token ids are drawn from: the server's when /v1/models reports it, else
// that of the model folder (model.path, or the embedded default model that `pdserve up` serves
// by default).
Result<std::int64_t> vocabularySize(const std::optional<bench::ServedModel>& served, const CommonConfig& common) {
  if (served && served->vocab_size > 0) return served->vocab_size;
  PD_ASSIGN_OR_RETURN(auto dir, resolveModelDir(common));
  PD_ASSIGN_OR_RETURN(auto config, ModelConfig::load(dir));
  log::info("bench", "token ids from the vocabulary of {} ({} tokens; --token-id-max overrides)", dir.string(),
            config.vocab_size);
  return config.vocab_size;
}

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
  BenchServeConfig cfg;
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
           "Prometheus pages with pdserve_decode_* counters (decode workers); empty: try --url's /metrics")
      .add("timeout_s", &cfg.timeout_s, "deadline of each request", 1, 86400)
      .add("json", &cfg.json, "write the JSON report to FILE; bare --json or '-': stdout")
      .add("markdown", &cfg.markdown,
           "write the markdown table to FILE ('-': stdout; default: stdout unless --json is)")
      .add("svg", &cfg.svg, "write an SVG chart (TTFT vs throughput, tokens/s vs concurrency)")
      .add("net_latency_ms", &cfg.net_latency_ms, "recorded in the JSON for pdserve plan --calibrate (-1: not given)",
           -1, 1e6)
      .add("quiet", &cfg.quiet, "no progress bar or per-level lines on stderr");
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
  if (cfg.token_id_max != 0 && cfg.token_id_min >= cfg.token_id_max) {
    return reportFailure(makeError(ErrorCode::InvalidArgument, "--token-id-min must be below --token-id-max"));
  }
  auto target = bench::parseUrl(cfg.url);
  if (!target.ok()) return reportFailure(target.error());
  target->api_key = cfg.api_key;

  const bool rate_mode = !cfg.request_rate.empty();
  std::vector<double> levels;
  if (rate_mode) {
    auto rates = bench::parsePositiveNumbers(cfg.request_rate, "request-rate");
    if (!rates.ok()) return reportFailure(rates.error());
    levels = *rates;
  } else {
    auto cs = bench::parsePositiveNumbers(cfg.concurrency, "concurrency");
    if (!cs.ok()) return reportFailure(cs.error());
    for (const double c : *cs) {
      if (c != std::floor(c) || c > 4096) {
        return reportFailure(makeError(ErrorCode::InvalidArgument, "--concurrency: levels must be integers 1..4096"));
      }
    }
    levels = *cs;
  }

  // The served model's name, context and vocabulary (a server without /v1/models needs --model).
  std::optional<bench::ServedModel> served;
  if (auto listed = bench::fetchModelList(*target); listed.ok()) {
    served = std::move(*listed);
  } else if (cfg.model.empty()) {
    return reportFailure(makeError(listed.error().code, listed.error().message + "; pass --model"));
  }
  if (cfg.model.empty()) cfg.model = served->id;

  bench::WorkloadOptions workload;
  workload.model = cfg.model;
  workload.endpoint = cfg.endpoint == "chat" ? bench::Endpoint::Chat : bench::Endpoint::Completions;
  workload.input_tokens = cfg.input_tokens;
  workload.output_tokens = cfg.output_tokens;
  workload.token_id_min = cfg.token_id_min;
  workload.token_id_max = cfg.token_id_max;
  if (cfg.prompts.empty()) {
    std::int64_t vocab = 0;
    if (cfg.token_id_max == 0 && workload.endpoint == bench::Endpoint::Completions) {
      auto size = vocabularySize(served, common);
      if (!size.ok()) return reportFailure(size.error());
      vocab = *size;
      workload.token_id_max = vocab;
    }
    auto fitted = bench::fitWorkload(workload, vocab, served ? served->max_model_len : 0);
    if (!fitted.ok()) return reportFailure(fitted.error());
    for (const auto& note : *fitted) log::info("bench", "fitted to the served model: {}", note);
  }
  workload.ignore_eos = cfg.ignore_eos;
  workload.return_token_ids = cfg.return_token_ids;
  workload.temperature = cfg.temperature;
  workload.seed = static_cast<std::uint64_t>(cfg.seed);
  std::vector<bench::RequestSpec> file_prompts;
  if (!cfg.prompts.empty()) {
    auto loaded_prompts = bench::loadPromptFile(cfg.prompts, workload);
    if (!loaded_prompts.ok()) return reportFailure(loaded_prompts.error());
    file_prompts = std::move(*loaded_prompts);
  }
  // Request i of every level (and of the warm-ups) is the i-th prompt, cycling through the file.
  const auto requests_for = [&](std::int64_t count, std::int64_t offset) {
    if (file_prompts.empty()) {
      auto w = workload;
      w.seed = workload.seed + static_cast<std::uint64_t>(offset) * 0x9E3779B9ULL;
      return bench::randomRequests(w, count);
    }
    std::vector<bench::RequestSpec> out;
    for (std::int64_t i = 0; i < count; ++i) {
      out.push_back(file_prompts[static_cast<std::size_t>(offset + i) % file_prompts.size()]);
    }
    return out;
  };

  // Server counters: the given pages, else --url's own /metrics if it exports decode counters.
  std::vector<std::string> metrics_urls = cfg.metrics_url;
  if (metrics_urls.empty()) {
    const std::string own = fmt::format("http://{}:{}/metrics", target->host, target->port);
    auto probe = bench::scrapeCounters({own}, 5s);
    if (probe.ok() &&
        (probe->contains(std::string(bench::kDecodeTokens)) || probe->contains(std::string(bench::kMtpProposed)))) {
      metrics_urls.push_back(own);
    }
  } else {
    auto probe = bench::scrapeCounters(metrics_urls, 10s);
    if (!probe.ok()) return reportFailure(probe.error());
  }

  bench::BenchReport report;
  auto& info = report.info;
  info.url = cfg.url;
  info.model = cfg.model;
  info.endpoint = cfg.endpoint;
  info.prompts = cfg.prompts.empty() ? "random" : cfg.prompts.string();
  info.input_tokens = workload.input_tokens;
  info.output_tokens = workload.output_tokens;
  info.ignore_eos = cfg.ignore_eos;
  info.seed = static_cast<std::uint64_t>(cfg.seed);
  info.mode = rate_mode ? "request_rate" : "concurrency";
  if (cfg.slo_ttft_ms > 0) info.slo.ttft_ms = cfg.slo_ttft_ms;
  if (cfg.slo_tpot_ms > 0) info.slo.tpot_ms = cfg.slo_tpot_ms;
  if (cfg.slo_e2e_ms > 0) info.slo.e2e_ms = cfg.slo_e2e_ms;
  if (cfg.net_latency_ms >= 0) info.net_latency_ms = cfg.net_latency_ms;
  info.started_at = utcNow();

  const bool tty = ::isatty(STDERR_FILENO) == 1 && !cfg.quiet;
  std::int64_t offset = 0;
  bool any_empty_level = false;
  for (std::size_t li = 0; li < levels.size(); ++li) {
    const double level = levels[li];
    bench::LevelPlan plan;
    std::int64_t count = cfg.num_prompts;
    if (rate_mode) {
      plan.workers = cfg.max_concurrency;
      plan.request_rate = level;
      if (count == 0) count = std::clamp<std::int64_t>(std::llround(level * 20), 16, 10000);
    } else {
      plan.workers = static_cast<std::int64_t>(level);
      if (count == 0) count = std::max<std::int64_t>(16, 4 * plan.workers);
    }
    const std::int64_t warmup =
        cfg.warmup >= 0 ? cfg.warmup : (rate_mode ? std::min<std::int64_t>(4, plan.workers) : plan.workers);
    plan.seed = static_cast<std::uint64_t>(cfg.seed) + li;
    plan.timeout = std::chrono::milliseconds(cfg.timeout_s * 1000);
    plan.warmup = requests_for(warmup, offset);
    offset += warmup;
    plan.requests = requests_for(count, offset);
    offset += count;
    std::map<std::string, double> before;
    bool have_before = false;
    if (!metrics_urls.empty()) {
      plan.on_timed_start = [&] {
        auto scraped = bench::scrapeCounters(metrics_urls, 10s);
        have_before = scraped.ok();
        if (scraped.ok()) before = std::move(*scraped);
      };
    }

    bench::LevelProgress progress;
    bench::LevelRun run;
    const std::string label = rate_mode ? fmt::format("rate {:g}/s", level)
                                        : fmt::format("c={} ({}/{})", plan.workers, li + 1, levels.size());
    {
      std::optional<bench::ProgressDisplay> display;
      if (tty) display.emplace(label, progress);
      run = bench::runLevel(*target, workload.endpoint, plan, &progress);
    }
    auto stats = bench::summarize(run.results, run.duration_s, info.slo);
    if (rate_mode) {
      stats.request_rate = level;
    } else {
      stats.concurrency = plan.workers;
    }
    if (have_before) {
      auto after = bench::scrapeCounters(metrics_urls, 10s);
      if (after.ok()) {
        stats.mtp = bench::mtpFromDeltas(bench::counterDelta(before, *after, bench::kMtpProposed),
                                         bench::counterDelta(before, *after, bench::kMtpAccepted),
                                         bench::counterDelta(before, *after, bench::kDecodeTokens),
                                         bench::counterDelta(before, *after, bench::kDecodeSteps));
      }
    }
    if (stats.completed == 0) any_empty_level = true;
    if (!cfg.quiet) {
      std::fprintf(stderr, "%s\n", bench::levelSummaryLine(stats).c_str());
      std::fflush(stderr);
    }
    report.levels.push_back(std::move(stats));
  }

  int rc = any_empty_level ? 1 : 0;
  const auto emit = [&](const std::string& where, const std::string& text) {
    auto written = writeText(where, text);
    if (!written.ok()) rc = reportFailure(written.error());
  };
  if (!cfg.json.empty()) emit(cfg.json, bench::toJson(report) + "\n");
  if (!cfg.markdown.empty()) {
    emit(cfg.markdown, bench::toMarkdown(report));
  } else if (cfg.json != "-") {
    emit("-", bench::toMarkdown(report));
  }
  if (!cfg.svg.empty()) emit(cfg.svg.string(), bench::toSvg(report));
  if (any_empty_level) std::fprintf(stderr, "pdserve bench serve: a level completed no request (see errors above)\n");
  return rc;
}

}  // namespace pd::cli
