#pragma once
/// The prefix-reuse workloads of `pdserve bench serve` (docs/benchmarks.md, "Prefix reuse"):
///
///   multiturn: N conversations x T turns. Every conversation starts with the same system prompt
///     (system_tokens); turn t adds turn_tokens of new user tokens, and turn t + 1's prompt is
///     turn t's prompt, turn t's answer (its token ids) and the new user tokens, so a server
///     with a prefix cache can reuse everything but the new tokens. `concurrency` conversations
///     run at once, each one turn after the other.
///   shared-prefix: K prefixes of prefix_tokens, each followed by requests_per_prefix suffixes of
///     suffix_tokens, sent interleaved (prefix 0's first, prefix 1's first, ..., prefix 0's
///     second, ...) at `concurrency`.
///
/// Prompts are token ids (/v1/completions), drawn from [token_id_min, token_id_max) by seed, so
/// two runs of one seed send the same prompts (answers, greedy, are the server's). An answer's
/// token ids outside that range (random-weight models emit ids the tokenizer lacks, which a server
/// refuses in a prompt) are folded into it before they join the history.
///
/// What is reported, for the later requests (multiturn: turns >= 2; shared-prefix: every request
/// but the first of each prefix), whose `reusable_tokens` is the prefix they share with what was
/// sent before (the previous turn's prompt; the shared prefix):
///   prefix_hit_rate: sum of cached_tokens (usage.prompt_tokens_details) / sum of reusable_tokens;
///   request_hit_rate: the fraction of them that reused more than what every group shares
///     (cached_tokens > the system prompt's tokens; shared-prefix: > 0), i.e. that went where
///     their own history was cached;
///   ttft p50 of the later requests and of the first ones.
/// multiturn_ttft_ratio: the later requests' TTFT p50 on the main server over that on a baseline
/// server (the same workload sent to --baseline_url right after, e.g. round_robin with the prefix
/// cache off).
/// transfer_bytes_ratio (multiturn, with the prefill workers' /metrics pages of both clusters): the
/// KV bytes the prefill workers put per later turn (pdserve_kv_put_bytes_total grown while only
/// later turns ran) on the main cluster over the baseline's, e.g. decode-side prefix reuse on vs
/// off. To attribute the bytes to later turns exactly, the workload then runs in two phases: every
/// conversation's first turn, then (after_first_turns) the later turns.
///
/// Thread rules: runConversations() blocks its caller and joins its threads; the rest is pure.

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/serve/runner.h"
#include "bench/serve/stats.h"

namespace pd::bench {

struct ConversationOptions {
  std::string workload = "multiturn";  ///< "multiturn" or "shared-prefix"
  std::string model;
  std::int64_t conversations = 8;  ///< N
  std::int64_t turns = 4;          ///< T
  std::int64_t system_tokens = 1024;
  std::int64_t turn_tokens = 128;
  std::int64_t prefixes = 4;  ///< K
  std::int64_t prefix_tokens = 2048;
  std::int64_t suffix_tokens = 32;
  std::int64_t requests_per_prefix = 8;
  std::int64_t output_tokens = 32;
  std::int64_t concurrency = 4;
  std::int64_t token_id_min = 100;
  std::int64_t token_id_max = 30000;  ///< exclusive
  std::uint64_t seed = 0;
  std::chrono::milliseconds timeout{600000};
  /// Multiturn: when set, every conversation's first turn runs first, then this is called (on the
  /// calling thread, no request in flight), then the later turns run.
  std::function<void()> after_first_turns;
};

/// One request of a conversation workload and how it went.
struct ConversationRequest {
  std::int64_t group = 0;            ///< the conversation (multiturn) or the prefix (shared-prefix)
  std::int64_t index = 0;            ///< the turn, or the request's rank within its prefix, from 0
  std::int64_t reusable_tokens = 0;  ///< shared with what this group sent before (0 for the first)
  /// Shared with every other group's prompts too (multiturn: the system prompt; else 0).
  std::int64_t common_tokens = 0;
  RequestResult result;
};

struct ConversationStats {
  std::int64_t requests = 0;
  std::int64_t failed = 0;
  std::vector<std::string> errors;  ///< the distinct errors of the failed requests (at most 5)
  std::int64_t later_requests = 0;  ///< index >= 1 and ok
  std::optional<double> prefix_hit_rate;
  std::optional<double> request_hit_rate;
  double ttft_p50_first_ms = 0;
  double ttft_p50_later_ms = 0;
  double e2e_p50_ms = 0;
  std::int64_t cached_tokens = 0;
  std::int64_t reusable_tokens = 0;
  std::int64_t prompt_tokens = 0;
  double duration_s = 0;
  /// KV bytes the prefill workers put while the later turns ran (two-phase multiturn with
  /// metrics pages); nullopt when not measured.
  std::optional<double> later_transfer_bytes;
};

/// Sends the workload to `target` (see the file comment). InvalidArgument for a workload name or
/// sizes that make no sense (no conversations, turns, prefixes, or tokens).
[[nodiscard]] Result<std::vector<ConversationRequest>> runConversations(const Target& target,
                                                                        const ConversationOptions& options,
                                                                        double* duration_s = nullptr);

[[nodiscard]] ConversationStats summarizeConversations(const std::vector<ConversationRequest>& requests,
                                                       double duration_s);

/// The JSON report: the workload, `main` and (when given) `baseline` stats, prefix_hit_rate and
/// multiturn_ttft_ratio and transfer_bytes_ratio (null with the reason when not measured) at the top
/// level.
[[nodiscard]] std::string conversationReportJson(const ConversationOptions& options, const std::string& url,
                                                 const ConversationStats& main, const std::string& baseline_url,
                                                 const std::optional<ConversationStats>& baseline);
/// A few lines for people.
[[nodiscard]] std::string conversationReportText(const ConversationOptions& options, const ConversationStats& main,
                                                 const std::optional<ConversationStats>& baseline);

}  // namespace pd::bench
