#pragma once
/// `pdserve bench prefill`: what KV streaming adds to time to first token. For each prompt
/// length, in the same run and interleaved, the prefill engine's TTFT (submit to the completion
/// record delivered):
///  - compute alone: the KV goes nowhere (the ceiling the other two are compared with);
///  - streaming: each layer's KV is put into a decode process's pool as soon as it is computed
///    (pdserve's way), the record follows the last put;
///  - send-after: the whole prompt is computed first, then every layer is put (the peers' way:
///    vLLM+NIXL, SGLang, TensorRT-LLM, Dynamo).
/// streaming_overhead = TTFT(streaming) / TTFT(compute alone) - 1 at 2048 tokens (or the length
/// nearest to it). The decode process is a receiver (runPrefillReceiver) started from
/// `receiver_argv`, which expects every planned transfer up front and reports arrivals on stdout.
///
/// Thread rules: the functions run on the caller's thread (the engine runs its own); the
/// arithmetic below is pure.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/kvtransfer/kvtransfer_config.h"

namespace pd::bench {

/// The lengths measured when none are given, before fitting them to the model's context.
inline constexpr std::int64_t kPrefillDefaultLengths[] = {512, 2048, 8192};
/// The length the headline overhead is reported at (or the nearest measured).
inline constexpr std::int64_t kPrefillHeadlineTokens = 2048;

/// "512,2048" -> {512, 2048}; InvalidArgument on anything but positive integers.
[[nodiscard]] Result<std::vector<std::int64_t>> parsePrefillLengths(const std::string& text);

/// The lengths to measure on a model of `context` tokens. Given lengths (`requested` non-empty)
/// must fit (InvalidArgument naming the first that does not); the defaults are cut at the
/// context, which is measured itself in place of the ones cut.
[[nodiscard]] Result<std::vector<std::int64_t>> fitPrefillLengths(const std::vector<std::int64_t>& requested,
                                                                  std::int64_t context);

/// The median (upper middle of an even count); 0 for none.
[[nodiscard]] double medianOf(std::vector<double> values);

/// TTFTs of one length, seconds, one entry per run.
struct PrefillRow {
  std::int64_t tokens = 0;
  std::vector<double> compute;
  std::vector<double> streaming;
  std::vector<double> send_after;
};

/// median(ttft) / median(ceiling) - 1: what a mode adds to compute alone.
[[nodiscard]] double overheadRatio(const std::vector<double>& ttft, const std::vector<double>& ceiling);

/// The row nearest kPrefillHeadlineTokens (the first on a tie); `rows` must not be empty.
[[nodiscard]] const PrefillRow& headlineRow(const std::vector<PrefillRow>& rows);

struct PrefillBenchConfig {
  std::filesystem::path model;  ///< resolved model folder
  std::vector<std::int64_t> lengths;
  std::int64_t runs = 3;
  std::int64_t threads = 0;
  std::int64_t chunk_size = 512;
  std::string kv_dtype = "bf16";
  bool batch_invariant = false;  ///< `model.batch_invariant`: the engine's batch-invariant mode
  kvtransfer::KvTransferConfig kvtransfer;
  /// The command line that starts the receiver, before its --lengths (e.g. {pdserve, "bench",
  /// "prefill", "--receiver", ...}).
  std::vector<std::string> receiver_argv;
};

struct PrefillBenchResult {
  std::vector<PrefillRow> rows;  ///< one per length, in order
  int threads = 0;               ///< compute threads the engine ran with
};

/// Runs the plan: a warm-up of each mode, then every length `runs` times with the modes
/// interleaved. Errors of the engine, the receiver or a transfer end it.
[[nodiscard]] Result<PrefillBenchResult> runPrefillBench(const PrefillBenchConfig& cfg);

/// The receiver (the decode process): expects request i + 1 with plan[i] tokens for every i,
/// prints "DESCRIPTOR <id> <base64>" for each, then "ARRIVED <id> ok|<error>" as records arrive,
/// until it is terminated (it returns only on an error).
[[nodiscard]] Status runPrefillReceiver(const std::filesystem::path& model, const kvtransfer::KvTransferConfig& kv,
                                        const std::string& kv_dtype, const std::vector<std::int64_t>& plan);

/// The report: one JSON object, or the table with the headline line.
[[nodiscard]] std::string prefillReportJson(const PrefillBenchConfig& cfg, const PrefillBenchResult& result);
[[nodiscard]] std::string prefillReportTable(const PrefillBenchResult& result);

}  // namespace pd::bench
