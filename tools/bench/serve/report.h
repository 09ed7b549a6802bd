#pragma once
/// What `pdserve bench serve` writes: one JSON object for machines (vLLM's metric names, plus
/// `output_tokens_per_s` and `concurrency` per level so `pdserve plan --calibrate` reads it), a
/// markdown table for people, an SVG chart (TTFT against output throughput, and tokens/s against
/// concurrency or request rate), and the progress and summary lines printed while it runs.
///
/// Thread rules: pure functions over values.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench/serve/stats.h"

namespace pd::bench {

/// The run's settings, echoed in every output.
struct RunInfo {
  std::string url;
  std::string model;
  std::string endpoint;            ///< "completions" or "chat"
  std::string prompts;             ///< "random" or the JSONL path
  std::int64_t input_tokens = 0;   ///< random prompts only
  std::int64_t output_tokens = 0;  ///< max_tokens asked
  bool ignore_eos = true;
  std::uint64_t seed = 0;
  std::string mode;  ///< "concurrency" or "request_rate"
  Slo slo;
  std::optional<double> net_latency_ms;  ///< as given by the user, for the planner's calibration
  std::string started_at;                ///< UTC, ISO 8601
};

struct BenchReport {
  RunInfo info;
  std::vector<LevelStats> levels;
};

std::string toJson(const BenchReport& report);
std::string toMarkdown(const BenchReport& report);
std::string toSvg(const BenchReport& report);

/// "c=8  [#####.....]  40/80 req  3 failed  1234 tok/s" for a tty progress bar (no newline).
std::string progressLine(const std::string& label, std::int64_t done, std::int64_t total, std::int64_t failed,
                         double output_tokens_per_s, bool warming_up, int width = 30);
/// One line per finished level, for stderr.
std::string levelSummaryLine(const LevelStats& level);
/// "concurrency 8" or "rate 2.5/s".
std::string levelLabel(const LevelStats& level);

/// Escapes &, <, >, " and ' for XML text and attributes.
std::string xmlEscape(std::string_view text);

}  // namespace pd::bench
