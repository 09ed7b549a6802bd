#pragma once
/// `pdserve bench comm`: latency of the host tensor-parallel communicator's allreduce of one
/// hidden vector between two processes (the decode step's per-layer collective at batch 1),
/// compared with ucx_perftest's one-way message latency (ucp_am_lat) for the same bytes over
/// UCX shared memory and TCP, measured in the same run. ratio = ours / ucx_perftest (lower is
/// better; ~1 means the collective costs one one-way message).
///
/// Thread rules: runCommBench() forks rank 1 and must run before the calling process starts any
/// thread; the arithmetic and the reports are pure.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"

namespace pd::bench {

struct CommBenchConfig {
  std::vector<std::int64_t> floats{7168, 256};  ///< 7168 = DeepSeek-V3's hidden size
  std::int64_t iterations = 5000;
  std::string perftest = "ucx_perftest";  ///< empty: no ceiling
  std::int64_t spin_us = 1000;            ///< ShmOptions::spin
};

/// Per-call latencies of the timed allreduces, microseconds.
struct LatencySummary {
  double median_us = 0;
  double mean_us = 0;
  double p99_us = 0;
};
/// Median (upper middle), mean and p99 (the value at index n*99/100 of the sorted samples);
/// zeros for none.
[[nodiscard]] LatencySummary summarizeLatencies(std::vector<double> us);

/// The median one-way latency (µs) on ucx_perftest's last CSV line
/// ("iterations,50.0_percentile_lat,avg_lat,..."); nullopt when there is none.
[[nodiscard]] std::optional<double> parsePerftestLatency(std::string_view output);

/// One message size.
struct CommRow {
  std::int64_t floats = 0;
  LatencySummary ours;
  std::optional<double> perftest_sm_us;  ///< nullopt: ucx_perftest unavailable or failed
  std::optional<double> perftest_tcp_us;
};

/// ours / perftest; nullopt without a ceiling.
[[nodiscard]] std::optional<double> ratioToCeiling(const LatencySummary& ours, const std::optional<double>& ceiling);

/// Measures every size: ours, then ucx_perftest over sm and tcp (a failure of ucx_perftest is
/// logged and leaves its ceiling empty; a failure of ours ends the run).
[[nodiscard]] Result<std::vector<CommRow>> runCommBench(const CommBenchConfig& cfg);

/// The report: the table with its legend, or one JSON object (one line).
[[nodiscard]] std::string commReportText(const std::vector<CommRow>& rows);
[[nodiscard]] std::string commReportJson(const CommBenchConfig& cfg, const std::vector<CommRow>& rows);

}  // namespace pd::bench
