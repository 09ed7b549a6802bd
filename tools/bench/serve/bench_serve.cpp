// The sweep of `pdserve bench serve` (bench_serve.h): checks, the served model, the workload,
// each level with its progress display and server counters, the reports.
#include "bench/serve/bench_serve.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <optional>

#include "bench/serve/conversation.h"
#include "bench/serve/progress_display.h"
#include "bench/serve/report.h"
#include "bench/serve/runner.h"
#include "bench/serve/server_metrics.h"
#include "bench/serve/stats.h"
#include "bench/serve/workload.h"
#include "pd/common/log.h"
#include "pd/engine/model_config.h"

namespace pd::bench {

Result<std::vector<double>> serveLevels(const ServeBenchConfig& cfg) {
  if (cfg.token_id_max != 0 && cfg.token_id_min >= cfg.token_id_max) {
    return makeError(ErrorCode::InvalidArgument, "--token-id-min must be below --token-id-max");
  }
  if (!cfg.request_rate.empty()) return parsePositiveNumbers(cfg.request_rate, "request-rate");
  PD_ASSIGN_OR_RETURN(std::vector<double> cs, parsePositiveNumbers(cfg.concurrency, "concurrency"));
  for (const double c : cs) {
    if (c != std::floor(c) || c > 4096) {
      return makeError(ErrorCode::InvalidArgument, "--concurrency: levels must be integers 1..4096");
    }
  }
  return cs;
}

LevelSize levelSize(const ServeBenchConfig& cfg, double level) {
  LevelSize size;
  size.requests = cfg.num_prompts;
  if (!cfg.request_rate.empty()) {
    size.workers = cfg.max_concurrency;
    if (size.requests == 0) size.requests = std::clamp<std::int64_t>(std::llround(level * 20), 16, 10000);
    size.warmup = cfg.warmup >= 0 ? cfg.warmup : std::min<std::int64_t>(4, size.workers);
  } else {
    size.workers = static_cast<std::int64_t>(level);
    if (size.requests == 0) size.requests = std::max<std::int64_t>(16, 4 * size.workers);
    size.warmup = cfg.warmup >= 0 ? cfg.warmup : size.workers;
  }
  return size;
}

namespace {

using namespace std::chrono_literals;

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
Result<std::int64_t> vocabularySize(const std::optional<ServedModel>& served, const ModelDirSource& model_dir) {
  if (served && served->vocab_size > 0) return served->vocab_size;
  PD_ASSIGN_OR_RETURN(auto dir, model_dir());
  PD_ASSIGN_OR_RETURN(auto config, ModelConfig::load(dir));
  log::info("bench", "token ids from the vocabulary of {} ({} tokens; --token-id-max overrides)", dir.string(),
            config.vocab_size);
  return config.vocab_size;
}

// A prefix-reuse workload (conversation.h) against --url, then --baseline_url when given.
Result<void> runConversationBench(const ServeBenchConfig& cfg, const ModelDirSource& model_dir,
                                  const std::vector<double>& levels) {
  PD_ASSIGN_OR_RETURN(Target target, parseUrl(cfg.url));
  target.api_key = cfg.api_key;
  ConversationOptions o;
  o.workload = cfg.workload;
  o.model = cfg.model;
  std::optional<ServedModel> served;
  if (auto listed = fetchModelList(target); listed.ok()) {
    served = std::move(*listed);
  } else if (o.model.empty()) {
    return makeError(listed.error().code, listed.error().message + "; pass --model");
  }
  if (o.model.empty()) o.model = served->id;
  o.conversations = cfg.conversations;
  o.turns = cfg.turns;
  o.system_tokens = cfg.system_tokens;
  o.turn_tokens = cfg.turn_tokens;
  o.prefixes = cfg.prefixes;
  o.prefix_tokens = cfg.prefix_tokens;
  o.suffix_tokens = cfg.suffix_tokens;
  o.requests_per_prefix = cfg.requests_per_prefix;
  o.output_tokens = cfg.output_tokens;
  o.concurrency = static_cast<std::int64_t>(levels.front());
  o.seed = static_cast<std::uint64_t>(cfg.seed);
  o.timeout = std::chrono::milliseconds(cfg.timeout_s * 1000);
  o.token_id_min = cfg.token_id_min;
  if (cfg.token_id_max != 0) {
    o.token_id_max = cfg.token_id_max;
  } else {
    PD_ASSIGN_OR_RETURN(o.token_id_max, vocabularySize(served, model_dir));
  }
  if (o.token_id_min >= o.token_id_max) o.token_id_min = 0;
  // Multiturn with the prefill workers' pages: the KV bytes they put while only later turns ran.
  const auto run = [&](const Target& t, const std::vector<std::string>& pages) -> Result<ConversationStats> {
    double duration = 0;
    ConversationOptions opts = o;
    std::optional<Result<std::map<std::string, double>>> before;
    if (o.workload == "multiturn" && !pages.empty()) {
      opts.after_first_turns = [&] { before = scrapeCounters(pages, 10s); };
    }
    PD_ASSIGN_OR_RETURN(auto requests, runConversations(t, opts, &duration));
    ConversationStats stats = summarizeConversations(requests, duration);
    if (before) {
      if (!before->ok()) return before->error();
      PD_ASSIGN_OR_RETURN(const auto after, scrapeCounters(pages, 10s));
      stats.later_transfer_bytes = counterDelta(before->value(), after, "pdserve_kv_put_bytes_total");
    }
    return stats;
  };
  PD_ASSIGN_OR_RETURN(const ConversationStats main, run(target, cfg.metrics_url));
  std::optional<ConversationStats> baseline;
  if (!cfg.baseline_url.empty()) {
    PD_ASSIGN_OR_RETURN(Target base, parseUrl(cfg.baseline_url));
    base.api_key = cfg.api_key;
    PD_ASSIGN_OR_RETURN(baseline, run(base, cfg.baseline_metrics_url));
  }
  if (!cfg.json.empty()) {
    PD_TRY(writeText(cfg.json, conversationReportJson(o, cfg.url, main, cfg.baseline_url, baseline) + "\n"));
  }
  if (cfg.json != "-")
    PD_TRY(writeText(cfg.markdown.empty() ? "-" : cfg.markdown, conversationReportText(o, main, baseline)));
  if (main.later_requests == 0 || (baseline && baseline->later_requests == 0)) {
    return makeError(ErrorCode::PeerFailed, "no later request completed (see the failures above)");
  }
  return okStatus();
}

}  // namespace

Result<void> runServeBench(ServeBenchConfig cfg, const ModelDirSource& model_dir) {
  PD_ASSIGN_OR_RETURN(const std::vector<double> levels, serveLevels(cfg));
  if (cfg.workload != "random") return runConversationBench(cfg, model_dir, levels);
  const bool rate_mode = !cfg.request_rate.empty();
  auto target = parseUrl(cfg.url);
  if (!target.ok()) return target.error();
  target->api_key = cfg.api_key;

  // The served model's name, context and vocabulary (a server without /v1/models needs --model).
  std::optional<ServedModel> served;
  if (auto listed = fetchModelList(*target); listed.ok()) {
    served = std::move(*listed);
  } else if (cfg.model.empty()) {
    return makeError(listed.error().code, listed.error().message + "; pass --model");
  }
  if (cfg.model.empty()) cfg.model = served->id;

  WorkloadOptions workload;
  workload.model = cfg.model;
  workload.endpoint = cfg.endpoint == "chat" ? Endpoint::Chat : Endpoint::Completions;
  workload.input_tokens = cfg.input_tokens;
  workload.output_tokens = cfg.output_tokens;
  workload.token_id_min = cfg.token_id_min;
  workload.token_id_max = cfg.token_id_max;
  if (cfg.prompts.empty()) {
    std::int64_t vocab = 0;
    if (cfg.token_id_max == 0 && workload.endpoint == Endpoint::Completions) {
      auto size = vocabularySize(served, model_dir);
      if (!size.ok()) return size.error();
      vocab = *size;
      workload.token_id_max = vocab;
    }
    auto fitted = fitWorkload(workload, vocab, served ? served->max_model_len : 0);
    if (!fitted.ok()) return fitted.error();
    for (const auto& note : *fitted) log::info("bench", "fitted to the served model: {}", note);
  }
  workload.ignore_eos = cfg.ignore_eos;
  workload.return_token_ids = cfg.return_token_ids;
  workload.temperature = cfg.temperature;
  workload.seed = static_cast<std::uint64_t>(cfg.seed);
  std::vector<RequestSpec> file_prompts;
  if (!cfg.prompts.empty()) {
    auto loaded_prompts = loadPromptFile(cfg.prompts, workload);
    if (!loaded_prompts.ok()) return loaded_prompts.error();
    file_prompts = std::move(*loaded_prompts);
  }
  // Request i of every level (and of the warm-ups) is the i-th prompt, cycling through the file.
  const auto requests_for = [&](std::int64_t count, std::int64_t offset) {
    if (file_prompts.empty()) {
      auto w = workload;
      w.seed = workload.seed + static_cast<std::uint64_t>(offset) * 0x9E3779B9ULL;
      return randomRequests(w, count);
    }
    std::vector<RequestSpec> out;
    out.reserve(static_cast<std::size_t>(count));
    for (std::int64_t i = 0; i < count; ++i) {
      out.push_back(file_prompts[static_cast<std::size_t>(offset + i) % file_prompts.size()]);
    }
    return out;
  };

  // Server counters: the given pages, else --url's own /metrics if it exports decode counters.
  std::vector<std::string> metrics_urls = cfg.metrics_url;
  if (metrics_urls.empty()) {
    const std::string own = fmt::format("http://{}:{}/metrics", target->host, target->port);
    auto probe = scrapeCounters({own}, 5s);
    if (probe.ok() && (probe->contains(std::string(kDecodeTokens)) || probe->contains(std::string(kMtpProposed)) ||
                       probe->contains("pdserve_prefill_compute_seconds_count"))) {
      metrics_urls.push_back(own);
    }
  } else {
    auto probe = scrapeCounters(metrics_urls, 10s);
    if (!probe.ok()) return probe.error();
  }

  BenchReport report;
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
    const LevelSize size = levelSize(cfg, level);
    LevelPlan plan;
    plan.workers = size.workers;
    if (rate_mode) plan.request_rate = level;
    const std::int64_t count = size.requests;
    const std::int64_t warmup = size.warmup;
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
        auto scraped = scrapeCounters(metrics_urls, 10s);
        have_before = scraped.ok();
        if (scraped.ok()) before = std::move(*scraped);
      };
    }

    LevelProgress progress;
    LevelRun run;
    const std::string label = rate_mode ? fmt::format("rate {:g}/s", level)
                                        : fmt::format("c={} ({}/{})", plan.workers, li + 1, levels.size());
    {
      std::optional<ProgressDisplay> display;
      if (tty) display.emplace(label, progress);
      run = runLevel(*target, workload.endpoint, plan, &progress);
    }
    auto stats = summarize(run.results, run.duration_s, info.slo);
    if (rate_mode) {
      stats.request_rate = level;
    } else {
      stats.concurrency = plan.workers;
    }
    if (have_before) {
      auto after = scrapeCounters(metrics_urls, 10s);
      if (after.ok()) {
        stats.mtp =
            mtpFromDeltas(counterDelta(before, *after, kMtpProposed), counterDelta(before, *after, kMtpAccepted),
                          counterDelta(before, *after, kDecodeTokens), counterDelta(before, *after, kDecodeSteps));
        stats.prefill = prefillFromDeltas(before, *after);
      }
    }
    if (stats.completed == 0) any_empty_level = true;
    if (!cfg.quiet) {
      std::fprintf(stderr, "%s\n", levelSummaryLine(stats).c_str());
      std::fflush(stderr);
    }
    report.levels.push_back(std::move(stats));
  }

  std::optional<Error> write_error;
  const auto emit = [&](const std::string& where, const std::string& text) {
    auto written = writeText(where, text);
    if (!written.ok() && !write_error) write_error = written.error();
  };
  if (!cfg.json.empty()) emit(cfg.json, toJson(report) + "\n");
  if (!cfg.markdown.empty()) {
    emit(cfg.markdown, toMarkdown(report));
  } else if (cfg.json != "-") {
    emit("-", toMarkdown(report));
  }
  if (!cfg.svg.empty()) emit(cfg.svg.string(), toSvg(report));
  if (write_error) return *write_error;
  if (any_empty_level) return makeError(ErrorCode::PeerFailed, "a level completed no request (see errors above)");
  return okStatus();
}

}  // namespace pd::bench
