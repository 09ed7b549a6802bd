#pragma once
/// `pdserve bench decode`: the decode worker's engine (DecodeEngine: its scheduler, the paged
/// latent KV pool, sampling) on the CPU engine, as ratios to ceilings measured in the same run
/// (DESIGN §7):
///  - step time and tokens/s per batch size, as memory-bandwidth utilization: bytes a step must
///    read (non-expert weights + the routed experts actually selected in that step + LM head +
///    latent KV, as the engine counts them) / step time / read bandwidth of a streaming probe;
///  - MTP speculation against a plain run of the same requests made right before
///    (bench/decode/mtp_gain.h). Random weights accept almost no drafts, so drafts come from a
///    BENCH-ONLY override (a decode::Drafter only this benchmark constructs) that proposes the
///    known greedy continuation with probability p, a wrong token otherwise;
///  - MTP with the model's own drafts (no override) on 8 chat questions rendered with the model's
///    chat template (when it has one), each prompt's KV computed by the engine as a prefill worker
///    does: the real acceptance and speedup beside the ideal for that acceptance;
///  - tracing's cost: the median step with each request's sink doing the decode worker's span
///    work (trace sample ratio 1.0, spans exported to a file) over the same run without it.
///
/// Thread rules: runDecodeBench() runs on the caller's thread (the engine's own pool does the
/// compute); the rest is pure.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/decode/mtp_gain.h"
#include "pd/common/result.h"

namespace pd::bench {

struct DecodeBenchConfig {
  /// Model folder; "default": the embedded default model (in cache_dir); empty: a make-model
  /// checkpoint of `preset` generated into a temp folder (removed at the end).
  std::filesystem::path model;
  std::string preset = "bench";
  std::filesystem::path cache_dir;  ///< where the embedded default model lives
  std::int64_t threads = 0;         ///< 0: every hardware thread
  std::vector<std::int64_t> batches{1, 4, 16, 64};
  std::int64_t context = 256;     ///< cached prompt tokens per sequence
  std::int64_t steps = 8;         ///< timed decode steps per batch size (after 2 warm-up steps)
  std::string kv_dtype = "bf16";  ///< "bf16", "f32" or "fp8"
  bool batch_invariant = false;   ///< `model.batch_invariant`: the engine's batch-invariant mode
  std::vector<std::int64_t> mtp_ks{1};
  std::int64_t mtp_tokens = 40;  ///< tokens per MTP run at batch 1
  std::int64_t bandwidth_mb = 2048;
  /// A JSON Schema: each batch size also runs with every sequence constrained to it (masks from
  /// the tokenizer's vocabulary, docs/structured-outputs.md) right after a plain run, and the step
  /// time ratio is printed. Empty: no constrained runs. The schema must not let a value end
  /// within the run (the requests stop only on max_tokens).
  std::string schema;
  /// The tokenizer for --schema (its vocabulary must fit the model's); empty: the model folder.
  std::filesystem::path tokenizer;
  bool json = false;  ///< one JSON object at the end instead of lines of text as it goes
  /// Time the step with and without the decode worker's span work (sample ratio 1.0) at
  /// min(16, largest batch), 5 alternating runs of max(steps, 16) timed steps each; prints the
  /// ratio of their median steps.
  bool tracing = true;
};

/// What one run of B requests through a DecodeEngine measured (warm-up steps excluded).
struct DecodeRun {
  std::int64_t batch = 0;
  std::int64_t steps = 0;
  std::int64_t tokens = 0;  ///< emitted by the timed steps
  std::vector<double> step_seconds;
  double wall_seconds = 0.0;     ///< sum of the timed steps
  double forward_seconds = 0.0;  ///< main-model forward calls of the timed steps
  double mtp_seconds = 0.0;      ///< MTP forward calls of the timed steps
  double bytes = 0.0;
  double experts = 0.0;
  double cpu_share = 0.0;        ///< CPU time / (step time x threads), averaged over the timed steps
  double grammar_seconds = 0.0;  ///< in output constraints (masks, accepts) during the timed steps
  double sample_seconds = 0.0;   ///< in the samplers (a constraint's mask applied included) during the timed steps
  std::int64_t drafts_proposed = 0;
  std::int64_t drafts_accepted = 0;
  std::vector<std::vector<std::int32_t>> outputs;  ///< per request: every token, the first included

  /// The median timed step (upper middle of an even count); 0 for none.
  [[nodiscard]] double medianStep() const;
  [[nodiscard]] StepTotals totals() const;
};

/// One MTP measurement: a speculative run against the plain run of the same requests.
struct MtpRow {
  double p = 0.0;  ///< the override's probability; < 0: the model's own drafts
  std::int64_t k = 0;
  DecodeRun run;
  MtpGain gain;

  [[nodiscard]] double acceptance() const { return acceptanceRate(run.totals()); }
  [[nodiscard]] double tokensPerSecond() const { return static_cast<double>(run.tokens) / run.wall_seconds; }
};

/// The row of `run` (k drafts, override probability p) against `plain`.
[[nodiscard]] MtpRow mtpRow(const DecodeRun& plain, DecodeRun run, std::int64_t k, double p);

/// One MtpRow as a JSON object (the override's p only for override rows).
[[nodiscard]] std::string mtpRowJson(const MtpRow& row);

/// One batch-sweep row as a JSON object (median step, tokens/s, bytes, MBU against `bandwidth`).
[[nodiscard]] std::string decodeRowJson(const DecodeRun& run, double bandwidth);

/// A sysfs cache size ("32768K", "2M", "512") in bytes; 0 when it has no digits.
[[nodiscard]] std::uint64_t parseCacheSize(const std::string& text);

/// Runs the batch sweep and the MTP measurements of `cfg` and prints them on stdout (lines as it
/// goes, or one JSON object at the end). Errors of the engine, the model or a request end it.
[[nodiscard]] Result<void> runDecodeBench(const DecodeBenchConfig& cfg);

}  // namespace pd::bench
