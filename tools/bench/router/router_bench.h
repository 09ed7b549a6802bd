#pragma once
/// `pdserve bench router`: what the router adds to a request's latency.
///
/// Starts a decode worker, a prefill worker and a router as child processes (the pdserve binary),
/// then times one-token completions of a fixed token-id prompt two ways, alternating so both see
/// the same machine noise:
///  - through the router: POST /v1/completions {"prompt": ids, "max_tokens": 1};
///  - direct: the bench plays the router itself over the workers' internal API (open the decode
///    stream, submit the prefill with its descriptor, read the token and the finish).
/// The router's overhead is the difference of the latency percentiles (router_overhead.h) at
/// each concurrency. Both ways do the same worker work; the difference is the router's HTTP front
/// end, validation, policy choice and relaying.
///
/// With `tracing` a second router on the same workers records every request's spans (trace
/// sample ratio 1.0, to a JSON lines file in a temp folder), and each round sends the same request
/// through both routers as well as directly: the traced router's percentiles sit in the same row,
/// with the ratio of its latency and of its overhead to the untraced router's (tracing's cost).
///
/// With hold_streams N it then opens N streaming completions at once and prints the router
/// process's thread count (/proc/<pid>/status) before and at most while they are open, next to
/// its configured I/O threads: an async router stays at I/O threads plus a small constant.
///
/// Thread rules: runRouterBench() blocks the caller (it starts one client thread per concurrent
/// request); the rest is pure.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"

namespace pd::bench {

struct RouterBenchConfig {
  std::filesystem::path executable;  ///< the pdserve binary that plays the three roles
  std::filesystem::path model;       ///< resolved model folder
  std::filesystem::path tokenizer;   ///< passed on as model.tokenizer when not empty
  std::vector<std::int64_t> concurrency{1, 64};
  std::int64_t requests = 256;  ///< timed requests per way and concurrency
  std::int64_t warmup = 16;
  std::int64_t prompt_tokens = 16;
  std::int64_t hold_streams = 0;  ///< 0: no held-streams thread count
  std::int64_t io_threads = 2;    ///< the router's
  bool json = false;              ///< one JSON object at the end instead of a line per level
  bool tracing = true;            ///< also time a router with tracing at sample ratio 1.0
};

/// The levels of "1,64": integers in 1..1024; InvalidArgument naming bench_router.concurrency
/// otherwise.
[[nodiscard]] Result<std::vector<std::int64_t>> parseConcurrencyLevels(const std::string& text);

/// The value of the unlabelled sample `name` in a Prometheus text exposition; -1 when absent.
[[nodiscard]] std::int64_t gaugeValue(std::string_view metrics_text, std::string_view name);

/// Runs the benchmark and prints its report on stdout. An error starting a role ends it;
/// failed requests are logged and make the result PeerFailed after the report.
[[nodiscard]] Result<void> runRouterBench(const RouterBenchConfig& cfg);

}  // namespace pd::bench
