#include "pd/kvtransfer/wire.h"

#include <fmt/format.h>

#include <array>
#include <limits>
#include <utility>

#include "byte_io.h"
#include "pd/common/choices.h"
#include "pd/common/kv_format.h"
#include "pd/trace/trace_context.h"

namespace pd::kvtransfer {
namespace {

using detail::ByteReader;
using detail::ByteWriter;

// Sanity caps far above any real deployment; they bound what a hostile peer can make us hold.
constexpr std::uint32_t kMaxAddressBytes = 64 * 1024;
constexpr std::uint32_t kMaxRkeyBytes = 64 * 1024;
constexpr std::uint32_t kMaxBlockIds = 1U << 22;
constexpr std::uint32_t kMaxTargets = 1024;
constexpr std::uint32_t kMaxRegionsPerTarget = 4096;
constexpr std::uint32_t kMaxHiddenFloats = 1U << 20;
constexpr std::uint32_t kMaxTopLogprobs = 4096;
constexpr std::uint32_t kMaxMessageChars = 64 * 1024;
constexpr std::size_t kRegionFixedBytes = 8 + 8 + 4 + 4 + 8 + 8 + 4;
constexpr std::size_t kTargetFixedBytes = 4 + 4 + 4 + 4;

// Wire codes are spelled out so that reordering an enum can never change the protocol.
constexpr std::array<std::pair<DType, std::uint8_t>, 7> kDTypeCodes{{
    {DType::BF16, 1},
    {DType::F32, 2},
    {DType::F16, 3},
    {DType::F8E4M3, 4},
    {DType::I32, 5},
    {DType::I64, 6},
    {DType::U8, 7},
}};
constexpr std::array<std::pair<ErrorCode, std::uint8_t>, 11> kErrorCodes{{
    {ErrorCode::InvalidArgument, 1},
    {ErrorCode::NotFound, 2},
    {ErrorCode::Io, 3},
    {ErrorCode::Corrupt, 4},
    {ErrorCode::Unsupported, 5},
    {ErrorCode::Timeout, 6},
    {ErrorCode::PeerFailed, 7},
    {ErrorCode::Cancelled, 8},
    {ErrorCode::Overloaded, 9},
    {ErrorCode::ResourceExhausted, 10},
    {ErrorCode::Internal, 11},
}};

template <class Enum, std::size_t N>
std::uint8_t toWire(const std::array<std::pair<Enum, std::uint8_t>, N>& table, Enum value) {
  for (const auto& [e, code] : table) {
    if (e == value) return code;
  }
  PD_CHECK_MSG(false, "enum value without a wire code");
  return 0;
}

template <class Enum, std::size_t N>
std::optional<Enum> fromWire(const std::array<std::pair<Enum, std::uint8_t>, N>& table, std::uint8_t code) {
  for (const auto& [e, c] : table) {
    if (c == code) return e;
  }
  return std::nullopt;
}

Error corrupt(std::string_view what, std::string_view detail) {
  return makeError(ErrorCode::Corrupt, fmt::format("{}: {}", what, detail));
}

void putHeader(ByteWriter& w, MessageType type) {
  w.put(kWireMagic);
  w.put(kProtocolVersion);
  w.put(static_cast<std::uint8_t>(type));
  w.put(std::uint8_t{0});
  w.put(std::uint32_t{0});  // payload length, patched by finish()
}

std::vector<std::uint8_t> finish(ByteWriter&& w) {
  PD_CHECK(w.size() - kWireHeaderBytes <= std::numeric_limits<std::uint32_t>::max());
  w.patchU32(8, static_cast<std::uint32_t>(w.size() - kWireHeaderBytes));
  return std::move(w).take();
}

void putCompat(ByteWriter& w, const CompatInfo& c) {
  w.put(c.protocol_version);
  w.put(c.model_hash);
  w.put(toWire(kDTypeCodes, c.kv_dtype));
  w.put(c.block_size);
  w.put(c.num_layers);
  w.put(c.kv_dim);
  w.put(c.tp_size);
}

std::string_view messageName(MessageType type) {
  switch (type) {
    case MessageType::KvDescriptor:
      return "KV descriptor";
    case MessageType::Completion:
      return "completion record";
    case MessageType::Failure:
      return "failure record";
  }
  return "message";
}

/// Checks the header and returns a reader over exactly the payload.
Result<ByteReader> openMessage(std::span<const std::uint8_t> bytes, MessageType expected) {
  const auto what = messageName(expected);
  PD_ASSIGN_OR_RETURN(const MessageType type, peekMessageType(bytes));
  if (type != expected) {
    return corrupt(what, fmt::format("the buffer holds a {}", messageName(type)));
  }
  ByteReader r(bytes.subspan(kWireHeaderBytes));
  return r;
}

Status finishMessage(const ByteReader& r, std::string_view what) {
  if (!r.ok()) return corrupt(what, "truncated, or a count exceeds its limit");
  if (r.remaining() != 0) return corrupt(what, fmt::format("{} trailing bytes", r.remaining()));
  return okStatus();
}

// Exactly a W3C version-00 traceparent: 55 bytes, "00-", lower-case hex ids that are not all
// zero and two flag digits (trace::parseTraceparent checks the fields; the length and the
// version here rule out the whitespace and later versions it also accepts).
bool isExactTraceparent(std::string_view text) {
  constexpr std::size_t kVersion00Bytes = 55;
  return text.size() == kVersion00Bytes && text.starts_with("00-") && trace::parseTraceparent(text).has_value();
}

Result<CompatInfo> getCompat(ByteReader& r) {
  CompatInfo c;
  c.protocol_version = r.get<std::uint16_t>();
  c.model_hash = r.get<std::uint64_t>();
  const auto dtype_code = r.get<std::uint8_t>();
  c.block_size = r.get<std::uint32_t>();
  c.num_layers = r.get<std::uint32_t>();
  c.kv_dim = r.get<std::uint32_t>();
  c.tp_size = r.get<std::uint32_t>();
  if (!r.ok()) return corrupt("KV descriptor", "truncated compatibility info");
  const auto dtype = fromWire(kDTypeCodes, dtype_code);
  if (!dtype) return corrupt("KV descriptor", fmt::format("unknown KV dtype code {}", dtype_code));
  c.kv_dtype = *dtype;
  return c;
}

// A list of (token, logprob) alternatives: a count, then each token and its logprob. The first
// token's and every further choice's alternatives share this layout.
void putAlternatives(ByteWriter& w, const std::vector<pd::TokenLogprob>& top) {
  w.put(static_cast<std::uint32_t>(top.size()));
  for (const auto& lp : top) {
    w.put(lp.token);
    w.putF32(lp.logprob);
  }
}

void getAlternatives(ByteReader& r, std::vector<pd::TokenLogprob>& top) {
  top.resize(r.getCount(kMaxTopLogprobs, 8));
  for (auto& lp : top) {
    lp.token = r.get<std::int32_t>();
    lp.logprob = r.getF32();
  }
}

}  // namespace

std::uint64_t CompatInfo::tokenBytes() const {
  return kvTokenBytes(kv_dtype, kv_dim);
}

std::uint64_t compatHash(const CompatInfo& info) {
  ByteWriter w;
  putCompat(w, info);
  const auto bytes = std::move(w).take();
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const auto b : bytes) {
    h ^= b;
    h *= 0x100000001b3ULL;
  }
  return h;
}

Status checkCompatible(const CompatInfo& ours, const CompatInfo& theirs) {
  const auto mismatch = [](std::string_view field, auto a, auto b) {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("KV compatibility mismatch: {}: ours {}, peer {}", field, a, b));
  };
  if (ours.protocol_version != theirs.protocol_version) {
    return mismatch("protocol_version", ours.protocol_version, theirs.protocol_version);
  }
  if (ours.model_hash != theirs.model_hash) {
    return mismatch("model_hash", fmt::format("{:016x}", ours.model_hash), fmt::format("{:016x}", theirs.model_hash));
  }
  if (ours.kv_dtype != theirs.kv_dtype)
    return mismatch("kv_dtype", dtypeName(ours.kv_dtype), dtypeName(theirs.kv_dtype));
  if (ours.block_size != theirs.block_size) return mismatch("block_size", ours.block_size, theirs.block_size);
  if (ours.num_layers != theirs.num_layers) return mismatch("num_layers", ours.num_layers, theirs.num_layers);
  if (ours.kv_dim != theirs.kv_dim) return mismatch("kv_dim", ours.kv_dim, theirs.kv_dim);
  if (ours.tp_size != theirs.tp_size) return mismatch("tp_size", ours.tp_size, theirs.tp_size);
  return okStatus();
}

const std::vector<std::uint32_t>& targetBlockIds(const KvDescriptor& descriptor, const KvTarget& target) {
  return target.block_ids.empty() ? descriptor.block_ids : target.block_ids;
}

std::vector<std::uint8_t> encode(const KvDescriptor& d) {
  ByteWriter w;
  putHeader(w, MessageType::KvDescriptor);
  w.put(d.transfer_id.hi);
  w.put(d.transfer_id.lo);
  putCompat(w, d.compat);
  w.put(compatHash(d.compat));
  w.put(d.num_tokens);
  w.put(d.timeout_ms);
  w.put(d.present_tokens);
  w.put(static_cast<std::uint32_t>(d.block_ids.size()));
  for (const auto id : d.block_ids) w.put(id);
  w.put(static_cast<std::uint32_t>(d.targets.size()));
  for (const auto& t : d.targets) {
    w.put(t.tp_rank);
    w.putBytes(t.worker_address);
    w.put(static_cast<std::uint32_t>(t.regions.size()));
    for (const auto& r : t.regions) {
      w.put(r.base_address);
      w.put(r.length);
      w.put(r.first_layer);
      w.put(r.num_layers);
      w.put(r.layer_stride);
      w.put(r.block_stride);
      w.putBytes(r.rkey);
    }
    w.put(static_cast<std::uint32_t>(t.block_ids.size()));
    for (const auto id : t.block_ids) w.put(id);
  }
  return finish(std::move(w));
}

std::vector<std::uint8_t> encode(const CompletionRecord& rec) {
  ByteWriter w;
  putHeader(w, MessageType::Completion);
  w.put(rec.transfer_id.hi);
  w.put(rec.transfer_id.lo);
  w.put(rec.compat_hash);
  w.put(rec.num_tokens);
  w.put(rec.first_token);
  w.put(static_cast<std::uint32_t>(rec.hidden_state.size()));
  for (const float v : rec.hidden_state) w.putF32(v);
  w.put(static_cast<std::uint8_t>(rec.first_logprob.has_value() ? 1 : 0));
  if (rec.first_logprob) {
    w.put(rec.first_logprob->token);
    w.putF32(rec.first_logprob->logprob);
  }
  putAlternatives(w, rec.top_logprobs);
  w.put(static_cast<std::uint32_t>(rec.choice_tokens.size()));
  for (const auto& c : rec.choice_tokens) {
    w.put(c.token);
    w.putF32(c.logprob);
    putAlternatives(w, c.top);
  }
  w.putString(rec.traceparent);
  return finish(std::move(w));
}

std::vector<std::uint8_t> encode(const FailureRecord& rec) {
  ByteWriter w;
  putHeader(w, MessageType::Failure);
  w.put(rec.transfer_id.hi);
  w.put(rec.transfer_id.lo);
  w.put(rec.compat_hash);
  w.put(toWire(kErrorCodes, rec.code));
  w.putString(rec.message);
  return finish(std::move(w));
}

Result<MessageType> peekMessageType(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kWireHeaderBytes) {
    return corrupt("KV wire message",
                   fmt::format("{} bytes, shorter than the {}-byte header", bytes.size(), kWireHeaderBytes));
  }
  ByteReader r(bytes);
  const auto magic = r.get<std::uint32_t>();
  const auto version = r.get<std::uint16_t>();
  const auto type = r.get<std::uint8_t>();
  const auto reserved = r.get<std::uint8_t>();
  const auto length = r.get<std::uint32_t>();
  if (magic != kWireMagic) return corrupt("KV wire message", fmt::format("bad magic 0x{:08x}", magic));
  if (version != kProtocolVersion) {
    return makeError(ErrorCode::Unsupported, fmt::format("KV wire message: protocol version {}, this build speaks {}",
                                                         version, kProtocolVersion));
  }
  if (type < 1 || type > 3) return corrupt("KV wire message", fmt::format("unknown message type {}", type));
  if (reserved != 0) return corrupt("KV wire message", "reserved header byte is not zero");
  if (length != bytes.size() - kWireHeaderBytes) {
    return corrupt("KV wire message", fmt::format("header says {} payload bytes, buffer holds {}", length,
                                                  bytes.size() - kWireHeaderBytes));
  }
  return static_cast<MessageType>(type);
}

Result<KvDescriptor> decodeKvDescriptor(std::span<const std::uint8_t> bytes) {
  constexpr std::string_view kWhat = "KV descriptor";
  PD_ASSIGN_OR_RETURN(ByteReader r, openMessage(bytes, MessageType::KvDescriptor));
  KvDescriptor d;
  d.transfer_id.hi = r.get<std::uint64_t>();
  d.transfer_id.lo = r.get<std::uint64_t>();
  PD_ASSIGN_OR_RETURN(d.compat, getCompat(r));
  const auto hash = r.get<std::uint64_t>();
  if (r.ok() && hash != compatHash(d.compat)) {
    return corrupt(kWhat, fmt::format("compatibility hash {:016x} does not match its fields ({:016x})", hash,
                                      compatHash(d.compat)));
  }
  if (r.ok() && d.compat.protocol_version != kProtocolVersion) {
    return corrupt(kWhat, fmt::format("compatibility info names protocol {}, header {}", d.compat.protocol_version,
                                      kProtocolVersion));
  }
  d.num_tokens = r.get<std::uint32_t>();
  d.timeout_ms = r.get<std::uint32_t>();
  d.present_tokens = r.get<std::uint32_t>();
  const auto num_blocks = r.getCount(kMaxBlockIds, 4);
  d.block_ids.reserve(num_blocks);
  for (std::uint32_t i = 0; i < num_blocks; ++i) d.block_ids.push_back(r.get<std::uint32_t>());
  if (!r.ok()) return corrupt(kWhat, "truncated block id list");
  // Present blocks are the decode worker's shared, read-only ones: a whole number of the
  // request's blocks, short of its last token (which the prefill side must compute and write).
  if (d.present_tokens != 0 &&
      (d.present_tokens >= d.num_tokens || d.compat.block_size == 0 || d.present_tokens % d.compat.block_size != 0 ||
       d.present_tokens / d.compat.block_size > d.block_ids.size())) {
    return corrupt(kWhat, fmt::format("{} present tokens: not a whole number of its {} blocks of {} short of its {} "
                                      "tokens",
                                      d.present_tokens, d.block_ids.size(), d.compat.block_size, d.num_tokens));
  }
  const auto num_targets = r.getCount(kMaxTargets, kTargetFixedBytes);
  d.targets.resize(num_targets);
  for (std::uint32_t ti = 0; ti < num_targets && r.ok(); ++ti) {
    auto& t = d.targets[ti];
    t.tp_rank = r.get<std::uint32_t>();
    t.worker_address = r.getBytes(kMaxAddressBytes);
    const auto num_regions = r.getCount(kMaxRegionsPerTarget, kRegionFixedBytes);
    t.regions.resize(num_regions);
    for (auto& reg : t.regions) {
      reg.base_address = r.get<std::uint64_t>();
      reg.length = r.get<std::uint64_t>();
      reg.first_layer = r.get<std::uint32_t>();
      reg.num_layers = r.get<std::uint32_t>();
      reg.layer_stride = r.get<std::uint64_t>();
      reg.block_stride = r.get<std::uint64_t>();
      reg.rkey = r.getBytes(kMaxRkeyBytes);
      if (!r.ok()) return corrupt(kWhat, fmt::format("truncated region of target {}", ti));
    }
    const auto own_blocks = r.getCount(kMaxBlockIds, 4);
    t.block_ids.reserve(own_blocks);
    for (std::uint32_t i = 0; i < own_blocks; ++i) t.block_ids.push_back(r.get<std::uint32_t>());
    if (!r.ok()) return corrupt(kWhat, fmt::format("truncated target {}", ti));
  }
  PD_TRY(finishMessage(r, kWhat));
  return d;
}

Result<CompletionRecord> decodeCompletionRecord(std::span<const std::uint8_t> bytes) {
  constexpr std::string_view kWhat = "completion record";
  PD_ASSIGN_OR_RETURN(ByteReader r, openMessage(bytes, MessageType::Completion));
  CompletionRecord rec;
  rec.transfer_id.hi = r.get<std::uint64_t>();
  rec.transfer_id.lo = r.get<std::uint64_t>();
  rec.compat_hash = r.get<std::uint64_t>();
  rec.num_tokens = r.get<std::uint32_t>();
  rec.first_token = r.get<std::int32_t>();
  const auto hidden = r.getCount(kMaxHiddenFloats, 4);
  rec.hidden_state.reserve(hidden);
  for (std::uint32_t i = 0; i < hidden; ++i) rec.hidden_state.push_back(r.getF32());
  const auto has_logprob = r.get<std::uint8_t>();
  if (r.ok() && has_logprob > 1) return corrupt(kWhat, fmt::format("logprob flag is {}, not 0 or 1", has_logprob));
  if (has_logprob == 1) {
    TokenLogprob lp;
    lp.token = r.get<std::int32_t>();
    lp.logprob = r.getF32();
    rec.first_logprob = lp;
  }
  getAlternatives(r, rec.top_logprobs);
  const auto choices = r.getCount(static_cast<std::uint32_t>(pd::kMaxChoices - 1), 12);
  rec.choice_tokens.resize(choices);
  for (auto& c : rec.choice_tokens) {
    c.token = r.get<std::int32_t>();
    c.logprob = r.getF32();
    getAlternatives(r, c.top);
  }
  // The trace context is advisory: one that is too long or not exact W3C is skipped (never
  // copied) and reads as absent; the record itself stands.
  const auto trace_bytes = r.getCount(std::numeric_limits<std::uint32_t>::max(), 1);
  const auto trace_raw = r.getView(trace_bytes);
  if (r.ok() && trace_bytes > 0) {
    const std::string_view text(reinterpret_cast<const char*>(trace_raw.data()), trace_raw.size());
    if (trace_bytes <= kMaxTraceparentBytes && isExactTraceparent(text)) {
      rec.traceparent = std::string(text);
    } else {
      rec.traceparent_dropped = true;
    }
  }
  PD_TRY(finishMessage(r, kWhat));
  return rec;
}

Result<FailureRecord> decodeFailureRecord(std::span<const std::uint8_t> bytes) {
  constexpr std::string_view kWhat = "failure record";
  PD_ASSIGN_OR_RETURN(ByteReader r, openMessage(bytes, MessageType::Failure));
  FailureRecord rec;
  rec.transfer_id.hi = r.get<std::uint64_t>();
  rec.transfer_id.lo = r.get<std::uint64_t>();
  rec.compat_hash = r.get<std::uint64_t>();
  const auto code = r.get<std::uint8_t>();
  rec.message = r.getString(kMaxMessageChars);
  PD_TRY(finishMessage(r, kWhat));
  const auto parsed = fromWire(kErrorCodes, code);
  if (!parsed) return corrupt(kWhat, fmt::format("unknown error code {}", code));
  rec.code = *parsed;
  return rec;
}

Result<Record> decodeRecord(std::span<const std::uint8_t> bytes) {
  PD_ASSIGN_OR_RETURN(const MessageType type, peekMessageType(bytes));
  switch (type) {
    case MessageType::Completion: {
      PD_ASSIGN_OR_RETURN(auto rec, decodeCompletionRecord(bytes));
      return Record{std::move(rec)};
    }
    case MessageType::Failure: {
      PD_ASSIGN_OR_RETURN(auto rec, decodeFailureRecord(bytes));
      return Record{std::move(rec)};
    }
    case MessageType::KvDescriptor:
      break;
  }
  return corrupt("KV record", "expected a completion or failure record, got a KV descriptor");
}

}  // namespace pd::kvtransfer
