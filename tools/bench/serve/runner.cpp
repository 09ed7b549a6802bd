// The sending threads of `pdserve bench serve` (runner.h).
#include "bench/serve/runner.h"

#include <fmt/format.h>

#include <algorithm>
#include <boost/json.hpp>
#include <charconv>
#include <thread>

namespace pd::bench {
namespace {

using Clock = std::chrono::steady_clock;

double secondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string clip(std::string_view text, std::size_t n = 200) {
  std::string out(text.substr(0, n));
  std::replace(out.begin(), out.end(), '\n', ' ');
  return out;
}

// The message of an OpenAI-style error object {"error": {"message": ...}}, or the text clipped.
std::string errorMessage(std::string_view body) {
  boost::system::error_code ec;
  const auto v = boost::json::parse(body, ec);
  if (!ec && v.is_object()) {
    if (const auto* e = v.as_object().if_contains("error")) {
      if (e->is_object()) {
        if (const auto* m = e->as_object().if_contains("message"); m != nullptr && m->is_string()) {
          return clip(m->as_string());
        }
      } else if (e->is_string()) {
        return clip(e->as_string());
      }
    }
    if (const auto* m = v.as_object().if_contains("message"); m != nullptr && m->is_string()) {
      return clip(m->as_string());
    }
  }
  return clip(body);
}

std::int64_t intOr(const boost::json::object& o, std::string_view key, std::int64_t fallback) {
  const auto* v = o.if_contains(key);
  if (v == nullptr) return fallback;
  if (v->is_int64()) return v->as_int64();
  if (v->is_uint64()) return static_cast<std::int64_t>(v->as_uint64());
  return fallback;
}

bool nonEmptyString(const boost::json::object& o, std::string_view key) {
  const auto* v = o.if_contains(key);
  return v != nullptr && v->is_string() && !v->as_string().empty();
}

// The output tokens one chunk carries: its token ids when the server returns them, else one
// for non-empty text (the usual one-token-per-chunk assumption of vLLM's benchmark).
std::int64_t chunkTokens(const boost::json::object& chunk, Endpoint endpoint) {
  const auto* choices = chunk.if_contains("choices");
  if (choices == nullptr || !choices->is_array() || choices->as_array().empty()) return 0;
  const auto& first = choices->as_array().front();
  if (!first.is_object()) return 0;
  const auto& choice = first.as_object();
  if (const auto* ids = choice.if_contains("token_ids"); ids != nullptr && ids->is_array()) {
    return static_cast<std::int64_t>(ids->as_array().size());
  }
  if (endpoint == Endpoint::Chat) {
    const auto* delta = choice.if_contains("delta");
    if (delta == nullptr || !delta->is_object()) return 0;
    const auto& d = delta->as_object();
    return nonEmptyString(d, "content") || nonEmptyString(d, "reasoning_content") ? 1 : 0;
  }
  return nonEmptyString(choice, "text") ? 1 : 0;
}

// Appends the token ids a chunk carries (return_token_ids), if any.
void appendTokenIds(const boost::json::object& chunk, std::vector<std::int64_t>& out) {
  const auto* choices = chunk.if_contains("choices");
  if (choices == nullptr || !choices->is_array() || choices->as_array().empty()) return;
  const auto& first = choices->as_array().front();
  if (!first.is_object()) return;
  const auto* ids = first.as_object().if_contains("token_ids");
  if (ids == nullptr || !ids->is_array()) return;
  for (const auto& id : ids->as_array()) {
    if (id.is_int64()) out.push_back(id.as_int64());
  }
}

}  // namespace

Result<ServedModel> fetchModelList(const Target& target) {
  http::Client client(target.host, target.port);
  http::ClientRequest req;
  req.target = target.prefix + "/v1/models";
  if (!target.api_key.empty()) req.headers.push_back({"Authorization", "Bearer " + target.api_key});
  PD_ASSIGN_OR_RETURN(auto response, client.send(req, std::chrono::seconds(30)));
  if (response.status != 200) {
    return makeError(ErrorCode::PeerFailed, fmt::format("GET /v1/models answered HTTP {}", response.status));
  }
  return parseModelList(response.body);
}

Result<Target> parseUrl(const std::string& url) {
  std::string rest = url;
  if (rest.starts_with("https://")) {
    return makeError(ErrorCode::InvalidArgument, "--url: https is not supported; use http:// (or a local proxy)");
  }
  if (rest.starts_with("http://")) rest = rest.substr(7);
  Target t;
  if (const auto slash = rest.find('/'); slash != std::string::npos) {
    t.prefix = rest.substr(slash);
    rest = rest.substr(0, slash);
    while (!t.prefix.empty() && t.prefix.back() == '/') t.prefix.pop_back();
    if (t.prefix.ends_with("/v1")) t.prefix.resize(t.prefix.size() - 3);
  }
  t.port = 80;
  std::string host = rest;
  if (!rest.empty() && rest.front() == '[') {  // [v6]:port
    const auto close = rest.find(']');
    if (close == std::string::npos) return makeError(ErrorCode::InvalidArgument, "--url: unbalanced '[' in " + url);
    host = rest.substr(1, close - 1);
    rest = rest.substr(close + 1);
    if (!rest.empty() && rest.front() != ':') return makeError(ErrorCode::InvalidArgument, "--url: bad host in " + url);
    rest = rest.empty() ? "" : rest.substr(1);
    if (rest.empty()) rest = "80";
  } else if (const auto colon = rest.rfind(':'); colon != std::string::npos) {
    host = rest.substr(0, colon);
    rest = rest.substr(colon + 1);
  } else {
    rest = "80";
  }
  unsigned port = 0;
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), port);
  if (ec != std::errc() || end != rest.data() + rest.size() || port == 0 || port > 65535) {
    return makeError(ErrorCode::InvalidArgument, "--url: bad port in " + url);
  }
  if (host.empty()) return makeError(ErrorCode::InvalidArgument, "--url: no host in " + url);
  t.host = host;
  t.port = static_cast<std::uint16_t>(port);
  return t;
}

RequestResult sendStreaming(http::Client& client, const Target& target, Endpoint endpoint, const RequestSpec& spec,
                            std::chrono::milliseconds timeout) {
  http::ClientRequest req;
  req.method = "POST";
  req.target = target.prefix + endpointPath(endpoint);
  req.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
  if (!target.api_key.empty()) req.headers.push_back({"Authorization", "Bearer " + target.api_key});
  req.body = spec.body;

  RequestResult r;
  std::int64_t counted_tokens = 0;
  std::int64_t usage_prompt = -1;
  std::int64_t usage_completion = -1;
  bool done = false;
  std::string stream_error;
  Clock::time_point last;
  const auto start = Clock::now();
  auto response = client.streamEvents(req, timeout, [&](const http::SseEvent& event) {
    const auto now = Clock::now();
    if (event.data == "[DONE]") {
      done = true;
      return true;
    }
    boost::system::error_code ec;
    const auto v = boost::json::parse(event.data, ec);
    if (ec || !v.is_object()) {
      stream_error = "malformed stream event: " + clip(event.data, 80);
      return false;
    }
    const auto& chunk = v.as_object();
    if (chunk.contains("error")) {
      stream_error = "error event: " + errorMessage(event.data);
      return false;
    }
    if (const auto* usage = chunk.if_contains("usage"); usage != nullptr && usage->is_object()) {
      usage_prompt = intOr(usage->as_object(), "prompt_tokens", usage_prompt);
      usage_completion = intOr(usage->as_object(), "completion_tokens", usage_completion);
      if (const auto* details = usage->as_object().if_contains("prompt_tokens_details");
          details != nullptr && details->is_object()) {
        r.cached_tokens = intOr(details->as_object(), "cached_tokens", r.cached_tokens);
      }
    }
    appendTokenIds(chunk, r.token_ids);
    const std::int64_t tokens = chunkTokens(chunk, endpoint);
    if (tokens > 0) {
      if (r.chunks == 0) {
        r.ttft_s = secondsBetween(start, now);
      } else {
        appendItl(r.itl_s, secondsBetween(last, now), tokens);
      }
      last = now;
      ++r.chunks;
      counted_tokens += tokens;
    }
    return true;
  });
  r.e2e_s = secondsBetween(start, Clock::now());
  if (!response.ok()) {
    r.error = response.error().toString();
    if (response.error().code == ErrorCode::PeerFailed && r.chunks > 0) r.error = "stream cut: " + r.error;
    return r;
  }
  if (response->status < 200 || response->status >= 300) {
    r.error = fmt::format("HTTP {}: {}", response->status, errorMessage(response->body));
    return r;
  }
  if (!stream_error.empty()) {
    r.error = stream_error;
    return r;
  }
  if (!done) {
    r.error = "stream ended before [DONE]";
    return r;
  }
  if (r.chunks == 0) {
    r.error = "stream carried no output";
    return r;
  }
  r.ok = true;
  r.output_tokens = usage_completion >= 0 ? usage_completion : counted_tokens;
  r.prompt_tokens = usage_prompt >= 0 ? usage_prompt : spec.prompt_tokens;
  return r;
}

LevelRun runLevel(const Target& target, Endpoint endpoint, const LevelPlan& plan, LevelProgress* progress) {
  const auto workers = static_cast<std::size_t>(std::max<std::int64_t>(plan.workers, 1));
  std::vector<http::Client> clients;
  clients.reserve(workers);
  for (std::size_t w = 0; w < workers; ++w) clients.emplace_back(target.host, target.port);

  // Warm-up: closed loop on the same connections; results dropped.
  if (!plan.warmup.empty()) {
    if (progress != nullptr) progress->warming_up = true;
    std::atomic<std::size_t> next{0};
    std::vector<std::thread> threads;
    for (std::size_t w = 0; w < std::min(workers, plan.warmup.size()); ++w) {
      threads.emplace_back([&, w] {
        for (auto i = next.fetch_add(1); i < plan.warmup.size(); i = next.fetch_add(1)) {
          if (!sendStreaming(clients[w], target, endpoint, plan.warmup[i], plan.timeout).ok) clients[w].disconnect();
        }
      });
    }
    for (auto& t : threads) t.join();
    if (progress != nullptr) progress->warming_up = false;
  }

  if (plan.on_timed_start) plan.on_timed_start();
  LevelRun run;
  run.results.resize(plan.requests.size());
  const std::vector<double> due =
      plan.request_rate > 0
          ? poissonArrivals(plan.request_rate, static_cast<std::int64_t>(plan.requests.size()), plan.seed)
          : std::vector<double>{};
  if (progress != nullptr) progress->total = static_cast<std::int64_t>(plan.requests.size());
  std::atomic<std::size_t> next{0};
  std::vector<Clock::time_point> finished(workers);
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (std::size_t w = 0; w < std::min(workers, plan.requests.size()); ++w) {
    threads.emplace_back([&, w] {
      finished[w] = t0;
      for (auto i = next.fetch_add(1); i < plan.requests.size(); i = next.fetch_add(1)) {
        if (!due.empty()) {
          std::this_thread::sleep_until(
              t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(due[i])));
        }
        auto result = sendStreaming(clients[w], target, endpoint, plan.requests[i], plan.timeout);
        finished[w] = Clock::now();
        // A failed exchange may leave the connection mid-response; start the next one afresh.
        if (!result.ok) clients[w].disconnect();
        if (progress != nullptr) {
          progress->done.fetch_add(1);
          if (!result.ok) progress->failed.fetch_add(1);
          progress->output_tokens.fetch_add(result.output_tokens);
        }
        run.results[i] = std::move(result);
      }
    });
  }
  for (auto& t : threads) t.join();
  const auto end = threads.empty() ? t0 : *std::max_element(finished.begin(), finished.begin() + threads.size());
  run.duration_s = std::max(secondsBetween(t0, end), 1e-9);
  return run;
}

}  // namespace pd::bench
