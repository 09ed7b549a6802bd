#pragma once
/// The load generator of `pdserve bench serve`: sends streaming OpenAI-API requests over real
/// HTTP (pd::http::Client, one keep-alive connection per sending thread) and times each one.
///
/// A level runs `workers` sending threads. Closed loop (request_rate = 0): each thread sends its
/// next request as soon as its previous one ends, so `workers` is the concurrency. Open loop
/// (request_rate > 0): request i is due at the i-th time of a seeded Poisson process and goes out
/// then, or as soon as a thread is free if all `workers` are busy (the cap keeps a slow server
/// from exhausting threads). Warm-up requests go first, at the same concurrency, and are not
/// counted. Failures (connect errors, non-2xx answers, error events, streams cut before
/// `[DONE]`, deadlines) are results with ok = false, never exceptions.
///
/// Thread rules: runLevel() blocks its caller and joins its threads before returning; the
/// counters in LevelProgress may be read from another thread while it runs.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/serve/stats.h"
#include "bench/serve/workload.h"
#include "pd/common/http_client.h"
#include "pd/common/result.h"

namespace pd::bench {

/// Where to send: http://host:port plus an optional path prefix (e.g. "/proxy").
struct Target {
  std::string host;
  std::uint16_t port = 0;
  std::string prefix;   ///< prepended to /v1/...; empty or starting with '/', no trailing '/'
  std::string api_key;  ///< sent as "Authorization: Bearer <key>" when not empty
};

/// Parses "http://host:port[/prefix]" (the scheme may be omitted; port defaults to 80).
/// Errors: InvalidArgument (https, a bad port, no host).
Result<Target> parseUrl(const std::string& url);

/// GET /v1/models of `target`: the first model listed, with its context and vocabulary when
/// reported (parseModelList). PeerFailed on a non-200 answer or an empty list.
Result<ServedModel> fetchModelList(const Target& target);

/// Sends one streaming request on `client` and measures it (the clock starts just before the
/// request is written).
RequestResult sendStreaming(http::Client& client, const Target& target, Endpoint endpoint, const RequestSpec& spec,
                            std::chrono::milliseconds timeout);

struct LevelPlan {
  std::int64_t workers = 1;  ///< sending threads: the concurrency, or the cap in rate mode
  double request_rate = 0;   ///< requests/s of a Poisson process; 0: closed loop
  std::uint64_t seed = 0;    ///< for the arrival times
  std::vector<RequestSpec> warmup;
  std::vector<RequestSpec> requests;
  std::chrono::milliseconds timeout{600000};  ///< per request
  /// Called on the calling thread between the warm-up and the timed requests (e.g. to read the
  /// server's counters); may be empty.
  std::function<void()> on_timed_start;
};

/// Live counters of the timed part of a level (for a progress bar).
struct LevelProgress {
  std::atomic<std::int64_t> total{0};
  std::atomic<std::int64_t> done{0};
  std::atomic<std::int64_t> failed{0};
  std::atomic<std::int64_t> output_tokens{0};
  std::atomic<bool> warming_up{false};
};

struct LevelRun {
  std::vector<RequestResult> results;  ///< in request order
  double duration_s = 0;               ///< first scheduled send → last answer
};

/// Runs the warm-up and the timed requests of one level; `progress` may be null.
LevelRun runLevel(const Target& target, Endpoint endpoint, const LevelPlan& plan, LevelProgress* progress);

}  // namespace pd::bench
