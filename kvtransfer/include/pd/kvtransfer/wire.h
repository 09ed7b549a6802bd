#pragma once
/// Wire messages of the KV data plane (docs/kv-transfer.md, "Messages").
///
/// Three messages cross process boundaries:
///  - KvDescriptor: decode -> router -> prefill. Where to write a request's latent KV: every
///    decode rank's UCX worker address, the packed remote keys and strides of its KV regions, the
///    block ids (per rank where a rank names its own), the compatibility information and the
///    transfer's time budget.
///  - CompletionRecord: prefill -> decode over the transport, after every put of the request is
///    remotely complete: first sampled token, last hidden state (the MTP input), logprobs, and
///    the W3C trace context of the prefill worker's completion span.
///  - FailureRecord: prefill -> decode, when the prefill side gives up on a request.
///
/// Every message starts with the same 12-byte header: magic "PDKV", protocol version (u16), message
/// type (u8), a reserved zero byte, payload length (u32). All integers are little-endian; a float
/// is its IEEE-754 bits. Vectors and byte strings are a u32 count followed by the elements.
/// Encoding is canonical: a buffer that decodes re-encodes to the same bytes (except a completion
/// record whose traceparent the decoder dropped: it re-encodes without it).
///
/// Decoders never trust their input: they check the header, every length against the bytes
/// left, enum values, the compatibility hash and trailing bytes, and return ErrorCode::Corrupt
/// (malformed) or ErrorCode::Unsupported (well-formed, but another protocol version).
///
/// Thread rules: values and pure functions; thread-safe.

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/common/generation.h"
#include "pd/common/result.h"
#include "pd/kvtransfer/transfer_id.h"

namespace pd::kvtransfer {

/// Bumped on any incompatible change of a message or of the KV layout rules.
inline constexpr std::uint16_t kProtocolVersion = 7;
/// "PDKV" read as a little-endian u32.
inline constexpr std::uint32_t kWireMagic = 0x564B4450;
inline constexpr std::size_t kWireHeaderBytes = 12;

enum class MessageType : std::uint8_t { KvDescriptor = 1, Completion = 2, Failure = 3 };

/// What must agree between a prefill and a decode worker for the bytes one writes to mean the
/// same to the other. Its hash travels in every message; the fields travel in the descriptor so
/// a mismatch can be reported field by field.
struct CompatInfo {
  std::uint16_t protocol_version = kProtocolVersion;
  std::uint64_t model_hash = 0;   ///< identifies the checkpoint (weights and config)
  DType kv_dtype = DType::BF16;   ///< element type of the latent KV cache (BF16 or F32)
  std::uint32_t block_size = 64;  ///< tokens per KV block
  std::uint32_t num_layers = 0;   ///< KV layers shipped: main layers + the MTP layer
  std::uint32_t kv_dim = 576;     ///< kv_lora_rank + qk_rope_head_dim
  std::uint32_t tp_size = 1;      ///< decode tensor-parallel ranks

  /// Bytes of one token of one layer: kv_dim * element size.
  [[nodiscard]] std::uint64_t tokenBytes() const;
  friend bool operator==(const CompatInfo&, const CompatInfo&) = default;
};

/// FNV-1a 64 over the canonical encoding of `info`.
[[nodiscard]] std::uint64_t compatHash(const CompatInfo& info);

/// Ok when `theirs` equals `ours`; otherwise Unsupported naming the first differing field with
/// both values ("block_size: ours 64, peer 32").
[[nodiscard]] Status checkCompatible(const CompatInfo& ours, const CompatInfo& theirs);

/// One registered memory range on a decode rank holding layers [first_layer, first_layer +
/// num_layers). Token t of layer l lives at base_address + (l - first_layer) * layer_stride +
/// block_ids[t / block_size] * block_stride + (t % block_size) * token_bytes.
struct KvRegion {
  std::uint64_t base_address = 0;
  std::uint64_t length = 0;
  std::uint32_t first_layer = 0;
  std::uint32_t num_layers = 0;
  std::uint64_t layer_stride = 0;
  std::uint64_t block_stride = 0;
  std::vector<std::uint8_t> rkey;  ///< packed remote key, opaque to everything but the transport
  friend bool operator==(const KvRegion&, const KvRegion&) = default;
};

/// One decode rank: where its transport listens and its KV regions.
struct KvTarget {
  std::uint32_t tp_rank = 0;
  std::vector<std::uint8_t> worker_address;  ///< opaque transport address
  std::vector<KvRegion> regions;
  /// This rank's own block ids, in place of KvDescriptor::block_ids (at least the blocks that
  /// num_tokens needs), where they differ from them:
  /// a rank on the staging path (docs/kv-transfer.md, "Staging path") receives into staging
  /// blocks that its own grant chose, so with decode tensor parallelism every rank names its own.
  /// Empty: the descriptor's block_ids. On the wire (protocol 7) after the regions.
  std::vector<std::uint32_t> block_ids;
  friend bool operator==(const KvTarget&, const KvTarget&) = default;
};

struct KvDescriptor {
  /// The transfer's only id on the wire (docs/kv-transfer.md, "Transfer ids"): 128 CSPRNG bits
  /// that the receiving transport's Transport::grant() draws (with TP, the first rank's grant
  /// draws it, the others keep it). The sender repeats it in every data message and record of
  /// this transfer; a receiver accepts nothing for an id it has not granted. Zero: not granted.
  TransferId transfer_id;
  CompatInfo compat;
  std::uint32_t num_tokens = 0;  ///< prompt tokens whose KV will be written
  /// The transfer's budget in ms, counted by each side from when it sees the descriptor (clocks
  /// of different machines are not compared).
  std::uint32_t timeout_ms = 0;
  /// The request's pool block ids (the same on every rank); a target with block_ids of its own
  /// is written at those instead (targetBlockIds).
  std::vector<std::uint32_t> block_ids;
  std::vector<KvTarget> targets;  ///< one per decode rank written to
  /// Leading prompt tokens whose KV the decode worker already holds (its prefix cache,
  /// docs/kv-memory.md "Prefix reuse on the decode side"): a whole number of blocks, fewer than
  /// num_tokens. The sender puts only tokens [present_tokens, num_tokens); the receiver grants
  /// writes only to the blocks after the present ones. 0: every block is written. On the wire
  /// (protocol 6) right after timeout_ms; last here so aggregate initializers keep their order.
  std::uint32_t present_tokens = 0;
  friend bool operator==(const KvDescriptor&, const KvDescriptor&) = default;
};

/// The block ids the sender writes target `target` at: its own when it lists them, otherwise the
/// descriptor's.
[[nodiscard]] const std::vector<std::uint32_t>& targetBlockIds(const KvDescriptor& descriptor, const KvTarget& target);

using pd::TokenLogprob;  // the generation vocabulary's (generation.h)

/// Longest CompletionRecord::traceparent the decoder reads (a W3C version-00 value is 55 bytes).
inline constexpr std::uint32_t kMaxTraceparentBytes = 64;

/// Sent after every put of the request is remotely complete.
struct CompletionRecord {
  TransferId transfer_id;         ///< the descriptor's
  std::uint64_t compat_hash = 0;  ///< filled by the sending transport
  std::uint32_t num_tokens = 0;   ///< tokens whose KV was written
  pd::TokenId first_token = 0;
  std::vector<float> hidden_state;            ///< last position's final hidden state (MTP input)
  std::optional<TokenLogprob> first_logprob;  ///< set when logprobs were requested
  std::vector<TokenLogprob> top_logprobs;     ///< alternatives, best first
  /// A generation of n > 1 choices (docs/kv-memory.md, "Choices"): the first tokens of choices
  /// 1..n-1, each sampled from the same last-position logits with its choice's seed
  /// (pd::choiceSeed); logprob and alternatives filled as for the first token. Empty for n = 1.
  std::vector<pd::SampledToken> choice_tokens;
  /// The W3C `traceparent` of the prefill worker's `prefill.completion` span (docs/observability.md),
  /// so that the decode worker's `decode.kv_record` span is its child; empty: no trace. On the
  /// wire a byte string after the choices' first tokens (the record's last field), covered by the record's HMAC like
  /// the rest. The decoder keeps only an exact version-00 value (`00-` 32 hex `-` 16 hex `-` 2 hex, lower case, no
  /// all-zero id) of at most kMaxTraceparentBytes and drops anything else without copying it (a longer one, bad
  /// syntax): the field then reads as empty, traceparent_dropped is set, and the record is otherwise accepted. A length
  /// past the message's end is Corrupt, as for every field. The encoder writes the field as it is.
  std::string traceparent;
  /// Set by the decoder only (never encoded): the record carried a traceparent it dropped. The
  /// receiving transport counts these (pdserve_kv_records_total{event="trace_dropped"}).
  bool traceparent_dropped = false;
  friend bool operator==(const CompletionRecord&, const CompletionRecord&) = default;
};

/// Sent when the prefill side gives up on a request; the decode side releases its blocks.
struct FailureRecord {
  TransferId transfer_id;  ///< the descriptor's
  std::uint64_t compat_hash = 0;
  ErrorCode code = ErrorCode::Internal;
  std::string message;
  friend bool operator==(const FailureRecord&, const FailureRecord&) = default;
};

using Record = std::variant<CompletionRecord, FailureRecord>;

[[nodiscard]] std::vector<std::uint8_t> encode(const KvDescriptor& descriptor);
[[nodiscard]] std::vector<std::uint8_t> encode(const CompletionRecord& record);
[[nodiscard]] std::vector<std::uint8_t> encode(const FailureRecord& record);

/// The message type of a buffer whose header is valid.
[[nodiscard]] Result<MessageType> peekMessageType(std::span<const std::uint8_t> bytes);

[[nodiscard]] Result<KvDescriptor> decodeKvDescriptor(std::span<const std::uint8_t> bytes);
[[nodiscard]] Result<CompletionRecord> decodeCompletionRecord(std::span<const std::uint8_t> bytes);
[[nodiscard]] Result<FailureRecord> decodeFailureRecord(std::span<const std::uint8_t> bytes);
/// A completion or failure record, whichever the header says.
[[nodiscard]] Result<Record> decodeRecord(std::span<const std::uint8_t> bytes);

}  // namespace pd::kvtransfer
