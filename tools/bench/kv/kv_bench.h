#pragma once
/// `pdserve bench kv`: time moving the latent KV of a prompt between two processes over the UCX
/// transport, reported as a ratio to ucx_perftest's put bandwidth measured in the same run, on
/// the same UCX_TLS and message size (docs/benchmarks.md, docs/kv-transfer.md).
///
/// runKvBench() forks once, before UCX starts: the child is the decode side (a KV pool of the
/// largest case, one descriptor per run with freshly shuffled block ids), the parent the prefill
/// side (one put per layer, as layer-wise streaming does, then the completion record). A run is
/// timed from beginTransfer to the success callback, which comes after the record is delivered.
/// Runs of pdserve and of ucx_perftest alternate, so both see the same machine noise; each case
/// reports medians. The first transfer of each case is a verified warm-up (every byte checked).
///
/// Thread rules: runKvBench() must run before the calling process starts any thread (it forks);
/// the arithmetic and the reports are pure.

#include <cstdint>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/kvtransfer/kvtransfer_config.h"

namespace pd::bench {

struct KvBenchConfig {
  std::vector<std::uint32_t> tokens{1024, 4096};  ///< prompt lengths to time
  std::int64_t runs = 7;
  std::int64_t layers = 61;
  std::int64_t block_size = 64;
  std::int64_t kv_dim = 576;              ///< kv_lora_rank + qk_rope_head_dim, BF16
  std::string perftest = "ucx_perftest";  ///< empty: no ceiling
  kvtransfer::KvTransferConfig kvtransfer;
};

/// "1024,4096" -> {1024, 4096}; InvalidArgument unless positive token counts.
[[nodiscard]] Result<std::vector<std::uint32_t>> parseKvTokenList(const std::string& text);

/// The median of the runs (the mean of the middle two for an even count); 0 for none.
[[nodiscard]] double medianOfRuns(std::vector<double> values);

/// Bytes of one prompt's latent KV: tokens x layers x token bytes.
[[nodiscard]] std::uint64_t kvPayloadBytes(std::uint32_t tokens, std::uint32_t layers, std::uint64_t token_bytes);
/// Puts of one prompt: one per block per layer.
[[nodiscard]] std::uint64_t kvPutCount(std::uint32_t tokens, std::uint32_t block_size, std::uint32_t layers);

/// One prompt length's runs.
struct KvCase {
  std::uint32_t tokens = 0;
  std::uint64_t bytes = 0;
  std::uint64_t puts = 0;
  std::vector<double> ours_bps;
  std::vector<double> ours_s;
  std::vector<double> perftest_poll_bps;
  std::vector<double> perftest_sleep_bps;
  std::vector<double> perftest_bps;     ///< per run, the better of the two wait modes: the ceiling
  std::vector<double> perftest_am_bps;  ///< ucp_am_bw, the better of the two modes (context only)
  /// median(ours) / median(ceiling); 0 without a ceiling.
  [[nodiscard]] double ratio() const;
};

struct KvBenchResult {
  std::string ucx_tls;
  std::string data_path;
  std::uint64_t put_bytes = 0;
  std::vector<KvCase> cases;
  /// The median of the cases' ratios: the headline.
  [[nodiscard]] double overallRatio() const;
};

/// Runs every case (see above). Errors of the transport, the receiver or ucx_perftest end it.
[[nodiscard]] Result<KvBenchResult> runKvBench(const KvBenchConfig& cfg);

/// The report: the table with its legend, or one JSON object (one line).
[[nodiscard]] std::string kvReportText(const KvBenchConfig& cfg, const KvBenchResult& result);
[[nodiscard]] std::string kvReportJson(const KvBenchConfig& cfg, const KvBenchResult& result);

}  // namespace pd::bench
