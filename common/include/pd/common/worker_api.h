#pragma once
/// The workers' internal HTTP API (docs/internal-api.md): the JSON messages the router exchanges
/// with decode and prefill workers, and their codecs. The router links only pd_common, so the KV
/// descriptor crosses it as opaque bytes (base64 of kvtransfer's wire encoding).
///
/// Decoders never trust their input: a missing or mistyped field, an out-of-range value or
/// malformed JSON is InvalidArgument naming the field, never an exception.
///
/// Thread rules: values and pure functions; thread-safe.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/generation.h"
#include "pd/common/result.h"

namespace pd::worker_api {

// Paths served by every worker: /health, /ready, /metrics, kStatusPath.
inline constexpr std::string_view kStatusPath = "/v1/internal/status";
// Decode worker.
inline constexpr std::string_view kDecodeOpenPath = "/v1/internal/decode";
inline constexpr std::string_view kDecodeAbortPath = "/v1/internal/decode/abort";
// Prefill worker.
inline constexpr std::string_view kPrefillPath = "/v1/internal/prefill";
inline constexpr std::string_view kPrefillCancelPath = "/v1/internal/prefill/cancel";
/// GET kKvEventsPath?after=SEQ&instance=ID: the prefix-cache blocks stored and removed since SEQ
/// (KvEvents; docs/internal-api.md, "KV events").
inline constexpr std::string_view kKvEventsPath = "/v1/internal/kv_events";

/// Largest id or string field accepted, in bytes.
inline constexpr std::size_t kMaxIdBytes = 256;
/// Largest `traceparent` field accepted (a W3C version-00 value is 55 bytes).
inline constexpr std::size_t kMaxTraceparentBytes = 128;
/// Largest `constraint` field accepted (the encoded output constraint), in bytes.
inline constexpr std::size_t kMaxConstraintBytes = std::size_t{256} << 10;
/// Largest `tool_call_format` field accepted, in bytes.
inline constexpr std::size_t kMaxToolCallFormatBytes = 32;

/// POST kDecodeOpenPath: admit a request and stream its tokens (NDJSON DecodeEvent lines).
struct DecodeOpen {
  std::string request_id;  ///< the router's id; unique among the worker's live requests
  std::int64_t prompt_tokens = 0;
  std::int64_t max_tokens = 16;  ///< the first token (sampled by prefill) counts
  /// Must equal what the prefill worker gets (same seed): decode replays the first draw.
  pd::SamplingParams sampling;
  bool logprobs = false;  ///< report each token's logprob (and sampling.top_logprobs alternatives)
  std::vector<pd::TokenId> stop_token_ids;
  bool ignore_eos = false;
  /// How long the worker waits for the KV record, over every prefill attempt together.
  std::int64_t kv_timeout_ms = 60000;
  /// Prefill failure records the worker absorbs (keeping the blocks) before it ends the
  /// request: attempts - 1. At least 1.
  std::int64_t prefill_attempts = 1;
  /// W3C traceparent of the caller's span (docs/observability.md); optional. Carried as text: the
  /// worker parses it strictly and starts a new trace when it is malformed.
  std::string traceparent;
  /// A resumed generation (docs/kv-memory.md, "Resume"): the tokens it produced before this leg,
  /// which are the last resumed_token_ids.size() of the prompt_tokens (fewer than them). The
  /// sampler resumes after them. Optional (empty when absent).
  std::vector<pd::TokenId> resumed_token_ids;
  /// When the generation arrived at the router (µs since the Unix epoch); the same on every leg
  /// of it. A decode worker preempts the latest arrival first. Optional (0: the open's arrival).
  std::int64_t arrival_us = 0;
  /// What the output must look like (grammar-constrained decoding, docs/structured-outputs.md):
  /// pd::structured::encodeConstraint's JSON text, at most kMaxConstraintBytes; empty: free text.
  /// Carried as text (pd_common does not link pd_structured): the worker decodes and compiles it
  /// and refuses it with InvalidArgument / Unsupported. Optional in the JSON.
  std::string constraint;
  /// The tool-call format a ToolCalls constraint is written in ("deepseek_v3", "deepseek_v31"), as
  /// the router's tool parser reads it; empty: deepseek_v3. Optional in the JSON.
  std::string tool_call_format;
  /// Conditional disaggregation (docs/kv-memory.md, "Local prefill"): the prompt's token ids
  /// (prompt_tokens of them) when the decode worker is to prefill the prompt itself; no prefill
  /// worker is involved and the descriptor event carries no descriptor. Optional (empty: the KV
  /// comes from a prefill worker).
  std::vector<pd::TokenId> local_prompt_token_ids;
  /// With a local prompt of a resumed generation: the first token, which the client already has
  /// (as PrefillSubmit::forced_first_token). Optional (-1: sampled).
  pd::TokenId forced_first_token = -1;
  /// OpenAI `n` (docs/kv-memory.md, "Choices"): the prompt's KV arrives once and the worker runs
  /// `choices` sequences over it. This stream carries choice 0; choices 1..n-1 each open a stream
  /// of their own with `attach_to` before the prefill is submitted. 1..pd::kMaxChoices; optional
  /// (1 when absent).
  std::int64_t choices = 1;
  /// Decode-side prefix reuse (docs/kv-memory.md, "Prefix reuse on the decode side"): the prompt's
  /// token ids (prompt_tokens of them) for a worker with a prefix cache, which attaches the cached
  /// blocks holding its leading blocks and says so in the descriptor (present_tokens). Optional
  /// (empty: no reuse); not with local_prompt_token_ids or attach_to.
  std::vector<pd::TokenId> prompt_token_ids;
  /// An attached choice: the request_id of the open stream (its `choices` > 1, its KV not yet
  /// arrived) whose prompt this choice shares, and the choice's index (1..choices-1). The worker
  /// answers with an empty Descriptor line (nothing to prefill) and then the choice's tokens. The
  /// other fields must equal the parent's except request_id (prompt_tokens, max_tokens, sampling,
  /// constraint: the parent's are used). Optional (empty: a stream of its own).
  std::string attach_to;
  std::int64_t choice = 0;
};

enum class DecodeEventType { Descriptor, Tokens, Finish, Error, Preempted };

/// One line of the decode stream. The first is Descriptor; then Tokens events; the last is
/// Finish, Error or Preempted (exactly one of them). A stream that ends without one was cut.
/// Preempted: the worker's KV pool ran dry and it gave this request's blocks up; the router
/// resumes the generation (prompt + the tokens streamed so far) on a worker with room.
struct DecodeEvent {
  DecodeEventType type = DecodeEventType::Tokens;
  // Descriptor
  std::string kv_descriptor;  ///< kvtransfer wire bytes (raw; base64 on the wire)
  /// InternalAuth::tag("descriptor", kv_descriptor) as hex; empty without a cluster secret.
  std::string kv_descriptor_tag;
  std::int64_t blocks = 0;  ///< KV blocks held for the request
  // Tokens
  std::vector<pd::TokenId> token_ids;
  std::vector<pd::SampledToken> logprobs;  ///< one per token id, when asked
  // Finish
  pd::FinishReason finish_reason = pd::FinishReason::Stop;  ///< Stop or Length
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;
  // Error (and Preempted: message, completion_tokens)
  ErrorCode code = ErrorCode::Internal;
  std::string message;
};

/// POST kDecodeAbortPath and kPrefillCancelPath: {"request_id": "..."} -> {"found": bool}.
struct AbortRequest {
  std::string request_id;
};

/// POST kPrefillPath: prefill the prompt into the decode worker's blocks; the response comes
/// when the request is over (PrefillOutcome on 200, an error body otherwise).
struct PrefillSubmit {
  std::string request_id;
  std::vector<pd::TokenId> token_ids;
  pd::SamplingParams sampling;
  bool logprobs = false;
  std::string kv_descriptor;      ///< as the decode worker's Descriptor event gave it (raw bytes)
  std::string kv_descriptor_tag;  ///< as the Descriptor event gave it (hex; empty without a secret)
  std::int64_t timeout_ms = 60000;
  /// W3C traceparent of the caller's span; optional (see DecodeOpen::traceparent).
  std::string traceparent;
  /// A resumed generation: the last resumed_tokens of token_ids were produced by it, not given
  /// (fewer than token_ids.size()); the first token is sampled as its (resumed_tokens + 1)-th.
  /// Optional (0 when absent).
  std::int64_t resumed_tokens = 0;
  /// A resumed generation whose next token is already known (it reached the client): the worker
  /// sends it as the first token instead of sampling one, so that the token after it is sampled
  /// by the decode worker from the decode path's logits (docs/kv-memory.md). Optional (-1: none).
  std::int64_t forced_first_token = -1;
  /// As DecodeOpen::constraint: the first token is sampled under it. Must equal D's.
  std::string constraint;
  std::string tool_call_format;  ///< as DecodeOpen::tool_call_format
  /// As DecodeOpen::choices: the worker samples that many first tokens (choice i seeded
  /// pd::choiceSeed(sampling.seed, i)) and sends them all in the completion record. Optional (1).
  std::int64_t choices = 1;
};

struct PrefillOutcome {
  pd::TokenId first_token = 0;
  std::int64_t prompt_tokens = 0;
  double queue_ms = 0.0;     ///< submit to first forward
  double compute_ms = 0.0;   ///< first forward to last layer computed
  double transfer_ms = 0.0;  ///< last layer computed to the record delivered
  /// Leading prompt tokens whose KV came from the worker's prefix cache (not recomputed).
  /// Optional in the JSON (0 when absent).
  std::int64_t cached_tokens = 0;
};

/// GET kStatusPath: what the router's policies and health polling read.
struct WorkerStatus {
  std::string role;    ///< "prefill" or "decode"
  bool ready = false;  ///< what GET /ready answers: false while draining, broken or busy
  /// Healthy but full: it cannot admit a minimal request now (decode: no KV block available;
  /// prefill: its queue is full). ready is false too. The router keeps a busy worker in rotation
  /// and routes around it while others are not busy. Optional in the JSON (false when absent).
  bool busy = false;
  bool draining = false;
  std::string model_hash;  ///< 16 hex digits; P and D of one deployment must agree
  std::int64_t queued_requests = 0;
  std::int64_t queued_tokens = 0;
  std::int64_t running_requests = 0;
  std::int64_t free_blocks = 0;
  std::int64_t total_blocks = 0;
  std::int64_t block_size = 0;
  /// Decode, data path rma: blocks of ended requests held until their transfer is over (not in
  /// free_blocks). Optional in the JSON (0 when absent).
  std::int64_t quarantined_blocks = 0;
  /// Decode: MTP drafts proposed and accepted since the worker started (acceptance = the ratio of
  /// their increases). Optional in the JSON (0 when absent).
  std::int64_t drafts_proposed = 0;
  std::int64_t drafts_accepted = 0;
  /// Where the KV pool (decode) or the prefix cache (prefill) lives: "host" (the CPU engine's,
  /// in host memory) or "cuda:N"; its element type ("bf16", "f32", "fp8") and bytes per rank
  /// (total_blocks of them; docs/gpu.md, "The GPU memory plan"). Optional in the JSON ("", 0).
  std::string kv_pool_memory;
  std::string kv_cache_dtype;
  std::int64_t kv_pool_bytes = 0;
  /// How KV reaches this worker's pool (kvtransfer.path resolved): "direct" or "staging".
  /// Optional in the JSON (empty when absent).
  std::string kv_transfer_path;
  /// Decode-side prefix reuse (docs/kv-memory.md): blocks the worker's prefix cache holds (idle
  /// ones are also in free_blocks), and the most it keeps (0: no prefix cache; the router then
  /// does not send prompt token ids). Optional in the JSON (0 when absent).
  std::int64_t prefix_cache_blocks = 0;
  std::int64_t prefix_cache_capacity = 0;
  /// Decode, conditional disaggregation (docs/kv-memory.md "Local prefill"): the longest prompt
  /// the worker prefills itself (decode.local_prefill_max_tokens); 0 when it prefills none (a
  /// tensor-parallel worker). The router sends longer prompts to a prefill worker. Optional in the
  /// JSON: -1 when absent (not reported: the router assumes no limit).
  std::int64_t local_prefill_max_tokens = -1;
};

/// Most block keys one KvEvents message may carry (snapshot blocks and events together).
inline constexpr std::size_t kMaxKvEventBlocks = std::size_t{1} << 20;

/// One change of a prefill worker's prefix cache: a block entered it (Stored) or left it (Removed).
struct KvEvent {
  std::uint64_t seq = 0;    ///< the worker's event number: consecutive, from 1
  bool stored = true;       ///< false: removed
  std::uint64_t block = 0;  ///< the block's prefix hash chain key (prefix_hash.h)
  friend bool operator==(const KvEvent&, const KvEvent&) = default;
};

/// GET kKvEventsPath: what a prefill worker's prefix cache did since the caller's `after`.
/// Either the events after it (consecutive: events[i].seq == after + 1 + i, the last one `seq`),
/// or, when the caller named another instance (the worker restarted), asked for events the
/// worker no longer keeps, or for a future one, a snapshot: every block held now, as of `seq`.
struct KvEvents {
  std::string instance_id;       ///< random per worker process; a new one means a restart (at most kMaxIdBytes)
  std::uint64_t model_hash = 0;  ///< the hash chain's root (16 hex digits on the wire)
  std::int64_t block_size = 0;   ///< tokens per block of the chain, > 0
  std::uint64_t seq = 0;         ///< the caller's next `after`
  bool snapshot = false;
  std::vector<std::uint64_t> blocks;  ///< snapshot: every block held (16 hex digits each)
  std::vector<KvEvent> events;        ///< not a snapshot: the events after the caller's `after`
  bool more = false;                  ///< more events follow `seq` (ask again at once)
  friend bool operator==(const KvEvents&, const KvEvents&) = default;
};

[[nodiscard]] std::string toJson(const DecodeOpen& value);
[[nodiscard]] std::string toJson(const DecodeEvent& value);  ///< one line, no '\n'
[[nodiscard]] std::string toJson(const AbortRequest& value);
[[nodiscard]] std::string toJson(const PrefillSubmit& value);
[[nodiscard]] std::string toJson(const PrefillOutcome& value);
[[nodiscard]] std::string toJson(const WorkerStatus& value);
[[nodiscard]] std::string toJson(const KvEvents& value);

[[nodiscard]] Result<DecodeOpen> parseDecodeOpen(std::string_view json);
[[nodiscard]] Result<DecodeEvent> parseDecodeEvent(std::string_view json);
[[nodiscard]] Result<AbortRequest> parseAbortRequest(std::string_view json);
[[nodiscard]] Result<PrefillSubmit> parsePrefillSubmit(std::string_view json);
[[nodiscard]] Result<PrefillOutcome> parsePrefillOutcome(std::string_view json);
[[nodiscard]] Result<WorkerStatus> parseWorkerStatus(std::string_view json);
/// Also refuses events that are not consecutive or do not end at `seq`, a snapshot with events,
/// and more than kMaxKvEventBlocks keys.
[[nodiscard]] Result<KvEvents> parseKvEvents(std::string_view json);

/// Error bodies of every internal endpoint: {"error":{"code":"Timeout","message":"..."}}.
[[nodiscard]] std::string errorJson(const Error& error);
/// The Error of an error body; a body that is not one becomes Corrupt with `status` in the
/// message.
[[nodiscard]] Error parseErrorJson(int status, std::string_view json);
/// The HTTP status an internal endpoint answers an error with: 400 InvalidArgument /
/// ResourceExhausted / Unsupported, 404 NotFound, 409 Cancelled, 502 PeerFailed / Corrupt / Io,
/// 503 Overloaded, 504 Timeout, 500 otherwise.
[[nodiscard]] int httpStatusFor(ErrorCode code);
/// The reverse of httpStatusFor over the same table, for statuses the HTTP server answers itself
/// (404 NotFound, 409 Cancelled, 503 Overloaded, ...; a status shared by several codes reads back
/// as the first: 400 InvalidArgument, 502 PeerFailed); any other 4xx is InvalidArgument, anything
/// else Internal.
[[nodiscard]] ErrorCode errorCodeForHttpStatus(int status);
/// The code errorCodeName() names; nullopt for an unknown name.
[[nodiscard]] std::optional<ErrorCode> parseErrorCode(std::string_view name);

[[nodiscard]] std::string base64Encode(std::string_view bytes);
/// InvalidArgument for characters outside the standard alphabet or bad padding.
[[nodiscard]] Result<std::string> base64Decode(std::string_view text);

}  // namespace pd::worker_api
