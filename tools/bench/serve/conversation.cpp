// The prefix-reuse workloads of `pdserve bench serve` (conversation.h).
#include "bench/serve/conversation.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <boost/json.hpp>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <tuple>

#include "bench/serve/workload.h"

namespace pd::bench {
namespace {

namespace json = boost::json;

std::string completionBody(const ConversationOptions& o, const std::vector<std::int64_t>& prompt) {
  json::array ids;
  ids.reserve(prompt.size());
  for (const std::int64_t t : prompt) ids.emplace_back(t);
  json::object body{
      {"model", o.model},   {"prompt", std::move(ids)}, {"max_tokens", o.output_tokens},
      {"temperature", 0},   {"stream", true},           {"stream_options", json::object{{"include_usage", true}}},
      {"ignore_eos", true}, {"return_token_ids", true}};
  return json::serialize(body);
}

std::vector<std::int64_t> tokensFor(const ConversationOptions& o, std::uint64_t stream, std::int64_t count) {
  return randomTokenIds(o.seed * 0x9E3779B97F4A7C15ULL + stream, count, o.token_id_min, o.token_id_max);
}

ConversationRequest send(http::Client& client, const Target& target, const ConversationOptions& o,
                         const std::vector<std::int64_t>& prompt) {
  ConversationRequest r;
  RequestSpec spec{completionBody(o, prompt), static_cast<std::int64_t>(prompt.size()), o.output_tokens};
  r.result = sendStreaming(client, target, Endpoint::Completions, spec, o.timeout);
  if (!r.result.ok) client.disconnect();
  return r;
}

double msP50(std::vector<double> seconds) {
  for (double& s : seconds) s *= 1e3;
  return percentile(std::move(seconds), 50);
}

json::value optionalNumber(const std::optional<double>& v) {
  return v ? json::value(*v) : json::value(nullptr);
}

json::object statsJson(const ConversationStats& s) {
  json::array errors;
  for (const auto& e : s.errors) errors.emplace_back(e);
  return json::object{{"requests", s.requests},
                      {"failed", s.failed},
                      {"errors", std::move(errors)},
                      {"later_requests", s.later_requests},
                      {"prefix_hit_rate", optionalNumber(s.prefix_hit_rate)},
                      {"request_hit_rate", optionalNumber(s.request_hit_rate)},
                      {"ttft_p50_first_ms", s.ttft_p50_first_ms},
                      {"ttft_p50_later_ms", s.ttft_p50_later_ms},
                      {"e2e_p50_ms", s.e2e_p50_ms},
                      {"cached_tokens", s.cached_tokens},
                      {"reusable_tokens", s.reusable_tokens},
                      {"prompt_tokens", s.prompt_tokens},
                      {"duration_s", s.duration_s},
                      {"later_transfer_bytes", optionalNumber(s.later_transfer_bytes)}};
}

}  // namespace

Result<std::vector<ConversationRequest>> runConversations(const Target& target, const ConversationOptions& o,
                                                          double* duration_s) {
  const bool multiturn = o.workload == "multiturn";
  if (!multiturn && o.workload != "shared-prefix") {
    return makeError(ErrorCode::InvalidArgument, "--workload: multiturn or shared-prefix");
  }
  if (o.concurrency < 1 || o.output_tokens < 1 || o.token_id_max <= o.token_id_min ||
      (multiturn && (o.conversations < 1 || o.turns < 1 || o.system_tokens + o.turn_tokens < 1)) ||
      (!multiturn && (o.prefixes < 1 || o.requests_per_prefix < 1 || o.prefix_tokens < 1 || o.suffix_tokens < 0))) {
    return makeError(ErrorCode::InvalidArgument, "conversation workload: sizes must be positive");
  }
  std::vector<ConversationRequest> out;
  std::mutex mu;
  const std::int64_t groups = multiturn ? o.conversations : o.prefixes * o.requests_per_prefix;
  const auto workers = static_cast<std::size_t>(std::min(o.concurrency, groups));
  const std::vector<std::int64_t> system = tokensFor(o, 1, o.system_tokens);
  std::vector<std::vector<std::int64_t>> prefixes;
  for (std::int64_t k = 0; !multiturn && k < o.prefixes; ++k) {
    prefixes.push_back(tokensFor(o, 1000 + static_cast<std::uint64_t>(k), o.prefix_tokens));
  }
  // Multiturn state per conversation; each phase hands a conversation to one worker at a time.
  struct History {
    std::vector<std::int64_t> prompt;
    std::int64_t reusable = 0;
    bool alive = true;
  };
  std::vector<History> histories(multiturn ? static_cast<std::size_t>(groups) : 0, History{system, 0, true});
  // Turn t of conversation g: each prompt extends the previous prompt and answer. False when it
  // failed (the rest of the conversation has no history to build on).
  const auto turn = [&](http::Client& client, std::int64_t g, std::int64_t t) {
    History& h = histories[static_cast<std::size_t>(g)];
    const auto user = tokensFor(o, 1'000'000 + static_cast<std::uint64_t>(g * o.turns + t), o.turn_tokens);
    h.prompt.insert(h.prompt.end(), user.begin(), user.end());
    ConversationRequest r = send(client, target, o, h.prompt);
    r.group = g;
    r.index = t;
    r.reusable_tokens = h.reusable;
    r.common_tokens = o.system_tokens;
    const bool ok = r.result.ok;
    h.reusable = static_cast<std::int64_t>(h.prompt.size());
    // The answer joins the history. Ids outside the prompts' range (a random-weight model emits
    // ids the tokenizer does not know, which a server refuses in a prompt) are folded into it,
    // keeping the answer's length.
    for (std::int64_t id : r.result.token_ids) {
      if (id < o.token_id_min || id >= o.token_id_max) {
        id = o.token_id_min + std::abs(id) % (o.token_id_max - o.token_id_min);
      }
      h.prompt.push_back(id);
    }
    {
      std::lock_guard lock(mu);
      out.push_back(std::move(r));
    }
    h.alive = ok;
    return ok;
  };
  // Runs every group through `work` on `workers` threads, each taking the next group.
  const auto phase = [&](const std::function<void(http::Client&, std::int64_t)>& work) {
    std::atomic<std::int64_t> next{0};
    std::vector<std::thread> threads;
    threads.reserve(workers);
    for (std::size_t w = 0; w < workers; ++w) {
      threads.emplace_back([&] {
        http::Client client(target.host, target.port);
        for (std::int64_t g = next.fetch_add(1); g < groups; g = next.fetch_add(1)) work(client, g);
      });
    }
    for (auto& t : threads) t.join();
  };
  const auto turns = [&](std::int64_t first, std::int64_t last) {
    return [&, first, last](http::Client& client, std::int64_t g) {
      for (std::int64_t t = first; t < last && histories[static_cast<std::size_t>(g)].alive; ++t) {
        if (!turn(client, g, t)) break;
      }
    };
  };
  const auto t0 = std::chrono::steady_clock::now();
  if (multiturn && o.after_first_turns) {
    phase(turns(0, 1));
    o.after_first_turns();
    phase(turns(1, o.turns));
  } else if (multiturn) {
    phase(turns(0, o.turns));
  } else {
    phase([&](http::Client& client, std::int64_t g) {
      // Request g: prefix g % K, its (g / K)-th suffix.
      const std::int64_t k = g % o.prefixes;
      std::vector<std::int64_t> prompt = prefixes[static_cast<std::size_t>(k)];
      const auto suffix = tokensFor(o, 2'000'000 + static_cast<std::uint64_t>(g), o.suffix_tokens);
      prompt.insert(prompt.end(), suffix.begin(), suffix.end());
      ConversationRequest r = send(client, target, o, prompt);
      r.group = k;
      r.index = g / o.prefixes;
      r.reusable_tokens = r.index == 0 ? 0 : o.prefix_tokens;
      std::lock_guard lock(mu);
      out.push_back(std::move(r));
    });
  }
  if (duration_s != nullptr) {
    *duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::ranges::sort(
      out, [](const auto& a, const auto& b) { return std::tie(a.group, a.index) < std::tie(b.group, b.index); });
  return out;
}

ConversationStats summarizeConversations(const std::vector<ConversationRequest>& requests, double duration_s) {
  ConversationStats s;
  s.duration_s = duration_s;
  std::vector<double> first;
  std::vector<double> later;
  std::vector<double> e2e;
  std::int64_t hits = 0;
  for (const auto& r : requests) {
    ++s.requests;
    if (!r.result.ok) {
      ++s.failed;
      if (s.errors.size() < 5 && std::ranges::find(s.errors, r.result.error) == s.errors.end()) {
        s.errors.push_back(r.result.error);
      }
      continue;
    }
    e2e.push_back(r.result.e2e_s);
    s.prompt_tokens += r.result.prompt_tokens;
    if (r.index == 0) {
      first.push_back(r.result.ttft_s);
      continue;
    }
    ++s.later_requests;
    later.push_back(r.result.ttft_s);
    s.cached_tokens += r.result.cached_tokens;
    s.reusable_tokens += r.reusable_tokens;
    if (r.result.cached_tokens > r.common_tokens) ++hits;
  }
  if (s.reusable_tokens > 0) {
    s.prefix_hit_rate = static_cast<double>(s.cached_tokens) / static_cast<double>(s.reusable_tokens);
  }
  if (s.later_requests > 0) s.request_hit_rate = static_cast<double>(hits) / static_cast<double>(s.later_requests);
  s.ttft_p50_first_ms = msP50(first);
  s.ttft_p50_later_ms = msP50(later);
  s.e2e_p50_ms = msP50(e2e);
  return s;
}

std::string conversationReportJson(const ConversationOptions& o, const std::string& url, const ConversationStats& main,
                                   const std::string& baseline_url, const std::optional<ConversationStats>& baseline) {
  json::object config{{"workload", o.workload},
                      {"conversations", o.conversations},
                      {"turns", o.turns},
                      {"system_tokens", o.system_tokens},
                      {"turn_tokens", o.turn_tokens},
                      {"prefixes", o.prefixes},
                      {"prefix_tokens", o.prefix_tokens},
                      {"suffix_tokens", o.suffix_tokens},
                      {"requests_per_prefix", o.requests_per_prefix},
                      {"output_tokens", o.output_tokens},
                      {"concurrency", o.concurrency},
                      {"seed", o.seed}};
  std::optional<double> ratio;
  if (baseline && baseline->ttft_p50_later_ms > 0 && main.later_requests > 0) {
    ratio = main.ttft_p50_later_ms / baseline->ttft_p50_later_ms;
  }
  const auto per_turn = [](const ConversationStats& s) -> std::optional<double> {
    if (!s.later_transfer_bytes || s.later_requests == 0) return std::nullopt;
    return *s.later_transfer_bytes / static_cast<double>(s.later_requests);
  };
  std::optional<double> bytes_ratio;
  const std::optional<double> main_bytes = per_turn(main);
  const double base_bytes = baseline ? per_turn(*baseline).value_or(0.0) : 0.0;
  if (main_bytes && base_bytes > 0) bytes_ratio = main_bytes.value_or(0.0) / base_bytes;
  json::object report{{"workload", o.workload},
                      {"url", url},
                      {"config", std::move(config)},
                      {"main", statsJson(main)},
                      {"prefix_hit_rate", optionalNumber(main.prefix_hit_rate)},
                      {"multiturn_ttft_ratio", optionalNumber(ratio)},
                      {"transfer_bytes_ratio", optionalNumber(bytes_ratio)},
                      {"transfer_bytes_per_later_turn", optionalNumber(main_bytes)}};
  if (!bytes_ratio) {
    report["transfer_bytes_note"] =
        "multiturn with --metrics_url (the prefill workers of --url) and --baseline_metrics_url (those of "
        "--baseline_url) measures it";
  } else {
    report["baseline_transfer_bytes_per_later_turn"] = base_bytes;
  }
  if (baseline) {
    report["baseline_url"] = baseline_url;
    report["baseline"] = statsJson(*baseline);
  }
  return json::serialize(report);
}

std::string conversationReportText(const ConversationOptions& o, const ConversationStats& main,
                                   const std::optional<ConversationStats>& baseline) {
  const auto rate = [](const std::optional<double>& v) { return v ? fmt::format("{:.3f}", *v) : std::string("-"); };
  std::string text = fmt::format(
      "{}: {} requests ({} failed); later requests {}: prefix hit rate {} (cached {} of {} reusable tokens), "
      "request hit rate {}; TTFT p50 first {:.1f} ms, later {:.1f} ms\n",
      o.workload, main.requests, main.failed, main.later_requests, rate(main.prefix_hit_rate), main.cached_tokens,
      main.reusable_tokens, rate(main.request_hit_rate), main.ttft_p50_first_ms, main.ttft_p50_later_ms);
  for (const auto& e : main.errors) text += "  failed: " + e + "\n";
  if (baseline) {
    for (const auto& e : baseline->errors) text += "  baseline failed: " + e + "\n";
    text += fmt::format(
        "baseline: {} requests ({} failed); prefix hit rate {}; TTFT p50 first {:.1f} ms, later {:.1f} ms; "
        "ttft ratio (later, main / baseline) {}\n",
        baseline->requests, baseline->failed, rate(baseline->prefix_hit_rate), baseline->ttft_p50_first_ms,
        baseline->ttft_p50_later_ms,
        baseline->ttft_p50_later_ms > 0 ? fmt::format("{:.3f}", main.ttft_p50_later_ms / baseline->ttft_p50_later_ms)
                                        : std::string("-"));
  }
  const auto bytes = [](const ConversationStats& s) {
    return s.later_transfer_bytes && s.later_requests > 0
               ? fmt::format("{:.0f}", *s.later_transfer_bytes / static_cast<double>(s.later_requests))
               : std::string("-");
  };
  if (main.later_transfer_bytes) {
    text += fmt::format("KV bytes put per later turn: {}", bytes(main));
    if (baseline && baseline->later_transfer_bytes) text += fmt::format(", baseline {}", bytes(*baseline));
    text += "\n";
  }
  return text;
}

}  // namespace pd::bench
