// Wire messages: every message round-trips, every decoder rejects malformed input cleanly, and
// thousands of seeded random and mutated buffers go through the same oracle as the libFuzzer
// target (tests/fuzz/kv_wire_oracle.h), so CI exercises the decoders without clang. The UCX blob
// checks (what a descriptor's worker addresses and remote keys must look like before UCX sees
// them) are tested here too, against the oracle's synthetic UCX 1.13 address and key.

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>

#include "fuzz/kv_wire_oracle.h"
#include "pd/kvtransfer/wire.h"
#include "pd/trace/trace_context.h"

namespace pd::kvtransfer {
namespace {

KvDescriptor randomDescriptor(std::mt19937_64& rng) {
  std::uniform_int_distribution<std::uint32_t> small(0, 6);
  KvDescriptor d;
  if ((rng() & 1) != 0) d.transfer_id = TransferId{rng(), rng()};
  d.compat.model_hash = rng();
  d.compat.kv_dtype = (rng() & 1) != 0 ? DType::BF16 : DType::F32;
  d.compat.block_size = 1 + small(rng) * 16;
  d.compat.num_layers = 1 + small(rng) * 10;
  d.compat.kv_dim = 576;
  d.compat.tp_size = 1 + small(rng);
  d.num_tokens = static_cast<std::uint32_t>(rng() % 5000);
  d.timeout_ms = static_cast<std::uint32_t>(rng());
  for (std::uint32_t i = 0, n = small(rng) * 7; i < n; ++i) d.block_ids.push_back(static_cast<std::uint32_t>(rng()));
  // Decode-side prefix reuse: whole blocks the decode worker has, short of the prompt's last token.
  const std::uint32_t whole =
      std::min<std::uint32_t>((d.num_tokens - 1) / d.compat.block_size, static_cast<std::uint32_t>(d.block_ids.size()));
  if (d.num_tokens > 0 && whole > 0 && (rng() & 1) != 0) {
    d.present_tokens = static_cast<std::uint32_t>(1 + rng() % whole) * d.compat.block_size;
  }
  for (std::uint32_t i = 0, n = small(rng); i < n; ++i) {
    KvTarget t;
    t.tp_rank = i;
    if ((rng() & 1) != 0) {
      t.worker_address = fuzz::referenceUcxAddress();  // a well-formed one, for mutations to break
    } else {
      t.worker_address.resize(std::size_t{small(rng)} * 50);
      for (auto& b : t.worker_address) b = static_cast<std::uint8_t>(rng());
    }
    for (std::uint32_t r = 0, nr = small(rng); r < nr; ++r) {
      KvRegion region{rng(), rng(), static_cast<std::uint32_t>(rng()), static_cast<std::uint32_t>(rng()), rng(),
                      rng(), {}};
      if ((rng() & 1) != 0) {
        region.rkey = fuzz::referenceUcxRkey();
      } else {
        region.rkey.resize(std::size_t{small(rng)} * 11);
        for (auto& b : region.rkey) b = static_cast<std::uint8_t>(rng());
      }
      t.regions.push_back(std::move(region));
    }
    // A staging rank's own block ids (protocol 7).
    if ((rng() & 3) == 0) {
      for (std::uint32_t b = 0, nb = small(rng) * 5; b < nb; ++b)
        t.block_ids.push_back(static_cast<std::uint32_t>(rng()));
    }
    d.targets.push_back(std::move(t));
  }
  return d;
}

CompletionRecord randomCompletion(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> value(-10.0F, 10.0F);
  CompletionRecord r;
  r.transfer_id = TransferId{rng(), rng()};
  r.compat_hash = rng();
  r.num_tokens = static_cast<std::uint32_t>(rng());
  r.first_token = static_cast<std::int32_t>(rng());
  r.hidden_state.resize(rng() % 300);
  for (auto& v : r.hidden_state) v = value(rng);
  if ((rng() & 1) != 0)
    r.first_logprob = TokenLogprob{static_cast<std::int32_t>(rng() % 129280), -value(rng) * value(rng)};
  for (std::uint64_t i = 0, n = rng() % 21; i < n; ++i) {
    r.top_logprobs.push_back(TokenLogprob{static_cast<std::int32_t>(rng() % 129280), value(rng)});
  }
  // n > 1: the other choices' first tokens, with or without alternatives.
  for (std::uint64_t i = 0, n = rng() % 4 == 0 ? rng() % 16 : 0; i < n; ++i) {
    SampledToken c{static_cast<std::int32_t>(rng() % 129280), value(rng), {}};
    for (std::uint64_t j = 0, k = rng() % 3; j < k; ++j) {
      c.top.push_back(TokenLogprob{static_cast<std::int32_t>(rng() % 129280), value(rng)});
    }
    r.choice_tokens.push_back(std::move(c));
  }
  if ((rng() & 1) != 0) {
    r.traceparent = trace::formatTraceparent(
        trace::SpanContext{trace::newTraceId(), trace::newSpanId(), static_cast<std::uint8_t>(rng() & 1)});
  }
  return r;
}

std::vector<std::uint8_t> validMessage(std::mt19937_64& rng) {
  switch (rng() % 3) {
    case 0:
      return encode(randomDescriptor(rng));
    case 1:
      return encode(randomCompletion(rng));
    default:
      return encode(FailureRecord{TransferId{rng(), rng()}, rng(), ErrorCode::Timeout, "deadline of 30000 ms expired"});
  }
}

TEST(KvWire, DescriptorRoundTrips) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 200; ++i) {
    const KvDescriptor d = randomDescriptor(rng);
    const auto bytes = encode(d);
    auto back = decodeKvDescriptor(bytes);
    ASSERT_TRUE(back.ok()) << back.error().toString();
    EXPECT_EQ(back.value(), d);
    EXPECT_EQ(encode(back.value()), bytes);
  }
}

TEST(KvWire, CompletionRecordRoundTrips) {
  std::mt19937_64 rng(2);
  for (int i = 0; i < 200; ++i) {
    const CompletionRecord r = randomCompletion(rng);
    auto back = decodeCompletionRecord(encode(r));
    ASSERT_TRUE(back.ok()) << back.error().toString();
    EXPECT_EQ(back.value(), r);
    auto any = decodeRecord(encode(r));
    ASSERT_TRUE(any.ok());
    ASSERT_TRUE(std::holds_alternative<CompletionRecord>(any.value()));
    EXPECT_EQ(std::get<CompletionRecord>(any.value()), r);
  }
}

// The record's trace context (docs/observability.md): the last field, a u32 length and the bytes.
// It travels exactly; anything that is not an exact W3C version-00 traceparent is dropped (the
// record reads as carrying none, and says it dropped one) without failing the record.
std::vector<std::uint8_t> withTraceField(const CompletionRecord& base, std::string_view field) {
  auto bytes = encode(base);  // base has no traceparent: its bytes end with a zero length
  bytes.resize(bytes.size() - 4);
  const auto n = static_cast<std::uint32_t>(field.size());
  bytes.insert(bytes.end(), reinterpret_cast<const std::uint8_t*>(&n), reinterpret_cast<const std::uint8_t*>(&n) + 4);
  bytes.insert(bytes.end(), field.begin(), field.end());
  const auto len = static_cast<std::uint32_t>(bytes.size() - kWireHeaderBytes);
  std::memcpy(bytes.data() + 8, &len, 4);
  return bytes;
}

TEST(KvWire, CompletionRecordTraceparentRoundTripsAndIsTheLastField) {
  CompletionRecord c;
  c.transfer_id = TransferId{7, 8};
  c.hidden_state = {0.5F};
  const std::string tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  c.traceparent = tp;
  const auto bytes = encode(c);
  auto back = decodeCompletionRecord(bytes);
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(back->traceparent, tp);
  EXPECT_FALSE(back->traceparent_dropped);
  EXPECT_EQ(back.value(), c);
  EXPECT_EQ(encode(back.value()), bytes);
  EXPECT_EQ(std::string(bytes.end() - static_cast<std::ptrdiff_t>(tp.size()), bytes.end()), tp);
  CompletionRecord without = c;
  without.traceparent.clear();
  EXPECT_EQ(bytes, withTraceField(without, tp));
}

TEST(KvWire, CompletionRecordWithoutTraceparentCarriesAnEmptyField) {
  CompletionRecord c;
  c.first_token = 3;
  const auto bytes = encode(c);
  ASSERT_GE(bytes.size(), 4U);
  EXPECT_EQ(std::vector<std::uint8_t>(bytes.end() - 4, bytes.end()), std::vector<std::uint8_t>(4, 0));
  auto back = decodeCompletionRecord(bytes);
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->traceparent.empty());
  EXPECT_FALSE(back->traceparent_dropped);
  EXPECT_EQ(back->first_token, 3);
}

TEST(KvWire, MalformedTraceparentIsDroppedAndTheRecordStands) {
  CompletionRecord base;
  base.transfer_id = TransferId{1, 2};
  base.num_tokens = 9;
  base.first_token = 42;
  const std::string good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  for (const std::string& bad : {
           std::string("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01"),  // upper case
           std::string("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),  // zero trace id
           std::string("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"),  // zero span id
           std::string("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),  // version ff
           std::string("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),  // not version 00
           good + "-x",                                                             // trailing fields
           " " + good.substr(1),                                                    // whitespace
           good.substr(0, 54),                                                      // short
           std::string("00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01"),  // separators
           std::string("00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01"),  // not hex
           std::string("\0\1\2", 3),                                                // binary
       }) {
    auto back = decodeCompletionRecord(withTraceField(base, bad));
    ASSERT_TRUE(back.ok()) << bad << ": " << back.error().toString();
    EXPECT_TRUE(back->traceparent.empty()) << bad;
    EXPECT_TRUE(back->traceparent_dropped) << bad;
    EXPECT_EQ(back->first_token, 42);
    EXPECT_EQ(back->num_tokens, 9U);
    EXPECT_EQ(back->transfer_id, base.transfer_id);
  }
  // The well-formed value in the same frame is kept.
  auto kept = decodeCompletionRecord(withTraceField(base, good));
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->traceparent, good);
  EXPECT_FALSE(kept->traceparent_dropped);
}

TEST(KvWire, OversizeTraceparentIsDroppedWithoutCopyingAndALyingLengthIsCorrupt) {
  CompletionRecord base;
  base.first_token = 5;
  // Over the cap (a valid value padded, and 1 MiB of junk): dropped, the record stands.
  const std::string good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  for (const std::string& big :
       {good + std::string(kMaxTraceparentBytes - good.size() + 1, '0'), std::string(std::size_t{1} << 20, 'a')}) {
    auto back = decodeCompletionRecord(withTraceField(base, big));
    ASSERT_TRUE(back.ok()) << back.error().toString();
    EXPECT_TRUE(back->traceparent.empty());
    EXPECT_TRUE(back->traceparent_dropped);
    EXPECT_EQ(back->first_token, 5);
  }
  // A length beyond the message's end (or up to 4 GiB) is a truncated record, as for any field.
  for (const std::uint32_t lie : {56U, 0xFFFFFFFFU}) {
    auto bytes = withTraceField(base, good);
    std::memcpy(bytes.data() + bytes.size() - good.size() - 4, &lie, 4);
    const auto r = decodeCompletionRecord(bytes);
    ASSERT_FALSE(r.ok()) << lie;
    EXPECT_EQ(r.error().code, ErrorCode::Corrupt);
  }
}

TEST(KvWire, FailureRecordRoundTripsEveryErrorCode) {
  for (int c = 0; c <= static_cast<int>(ErrorCode::Internal); ++c) {
    const FailureRecord r{TransferId{42, 43}, 0xabcdef, static_cast<ErrorCode>(c), "prefill worker lost its GPU"};
    auto back = decodeFailureRecord(encode(r));
    ASSERT_TRUE(back.ok()) << back.error().toString();
    EXPECT_EQ(back.value(), r);
    auto any = decodeRecord(encode(r));
    ASSERT_TRUE(any.ok());
    EXPECT_EQ(std::get<FailureRecord>(any.value()), r);
  }
}

// The transfer id is the only id on the wire: all 128 bits of it, right after the header, in every
// message (little-endian hi, then lo), and a descriptor carries nothing else that names the request.
TEST(KvWire, EveryMessageCarriesTheFull128BitTransferIdAfterTheHeader) {
  const TransferId id{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  const auto read_id = [](const std::vector<std::uint8_t>& bytes) {
    TransferId back;
    std::memcpy(&back.hi, bytes.data() + kWireHeaderBytes, 8);
    std::memcpy(&back.lo, bytes.data() + kWireHeaderBytes + 8, 8);
    return back;
  };
  KvDescriptor d;
  d.transfer_id = id;
  CompletionRecord c;
  c.transfer_id = id;
  const FailureRecord f{id, 5, ErrorCode::Timeout, "late"};
  for (const auto& bytes : {encode(d), encode(c), encode(f)}) {
    EXPECT_EQ(read_id(bytes), id);
    // Both halves matter: another id in either half decodes to another transfer.
    for (const std::size_t at : {kWireHeaderBytes, kWireHeaderBytes + 15}) {
      auto changed = bytes;
      changed[at] ^= 0x01;
      EXPECT_NE(read_id(changed), id);
    }
  }
  auto back_d = decodeKvDescriptor(encode(d));
  ASSERT_TRUE(back_d.ok());
  EXPECT_EQ(back_d->transfer_id, id);
  auto back_f = decodeFailureRecord(encode(f));
  ASSERT_TRUE(back_f.ok());
  EXPECT_EQ(back_f->transfer_id, id);
  // The id changed in its low half: still a valid message, but of another transfer.
  auto flipped = encode(c);
  flipped[kWireHeaderBytes + 15] ^= 0x80;
  auto back_c = decodeCompletionRecord(flipped);
  ASSERT_TRUE(back_c.ok());
  EXPECT_NE(back_c->transfer_id, id);
  EXPECT_EQ(back_c->transfer_id.hi, id.hi);
  // Messages of earlier protocols (2: 64-bit ids; 3: no choices' first tokens; 4: no trace
  // context; 5: no present tokens in the descriptor; 6: no block ids of a target's own) are refused
  // as another version.
  for (const std::uint8_t older : {2, 3, 4, 5, 6}) {
    auto old = encode(c);
    old[4] = older;
    EXPECT_EQ(decodeCompletionRecord(old).error().code, ErrorCode::Unsupported);
    auto old_d = encode(d);
    old_d[4] = older;
    EXPECT_EQ(decodeKvDescriptor(old_d).error().code, ErrorCode::Unsupported);
  }
  EXPECT_EQ(kProtocolVersion, 7);
}

TEST(KvWire, HeaderIsCheckedFieldByField) {
  const auto good = encode(FailureRecord{TransferId{1, 1}, 2, ErrorCode::Cancelled, "x"});
  ASSERT_TRUE(decodeFailureRecord(good).ok());

  auto bad_magic = good;
  bad_magic[0] ^= 0xFF;
  EXPECT_EQ(decodeFailureRecord(bad_magic).error().code, ErrorCode::Corrupt);
  EXPECT_NE(decodeFailureRecord(bad_magic).error().message.find("magic"), std::string::npos);

  auto newer = good;
  newer[4] = kProtocolVersion + 1;
  EXPECT_EQ(decodeFailureRecord(newer).error().code, ErrorCode::Unsupported);
  EXPECT_NE(decodeFailureRecord(newer).error().message.find("protocol version"), std::string::npos);

  auto reserved = good;
  reserved[7] = 1;
  EXPECT_EQ(decodeFailureRecord(reserved).error().code, ErrorCode::Corrupt);

  auto unknown_type = good;
  unknown_type[6] = 9;
  EXPECT_EQ(peekMessageType(unknown_type).error().code, ErrorCode::Corrupt);

  EXPECT_EQ(decodeCompletionRecord(good).error().code, ErrorCode::Corrupt);  // wrong type
  EXPECT_EQ(decodeKvDescriptor(good).error().code, ErrorCode::Corrupt);
  EXPECT_EQ(decodeRecord(encode(KvDescriptor{})).error().code, ErrorCode::Corrupt);

  auto trailing = good;
  trailing.push_back(0);
  EXPECT_EQ(decodeFailureRecord(trailing).error().code, ErrorCode::Corrupt);  // length mismatch
  trailing[8] += 1;  // header now claims the extra byte: the payload has a trailing byte
  EXPECT_EQ(decodeFailureRecord(trailing).error().code, ErrorCode::Corrupt);
  EXPECT_NE(decodeFailureRecord(trailing).error().message.find("trailing"), std::string::npos);
}

TEST(KvWire, EveryTruncationIsRejected) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 20; ++i) {
    const auto bytes = validMessage(rng);
    for (std::size_t n = 0; n < bytes.size(); ++n) {
      const std::span<const std::uint8_t> prefix(bytes.data(), n);
      EXPECT_FALSE(decodeKvDescriptor(prefix).ok());
      EXPECT_FALSE(decodeCompletionRecord(prefix).ok());
      EXPECT_FALSE(decodeFailureRecord(prefix).ok());
    }
  }
}

// A payload length that matches the buffer but inner counts that lie must not allocate or read
// past the end.
TEST(KvWire, HostileCountsAreRejectedWithoutAllocating) {
  KvDescriptor d;
  d.block_ids = {1, 2, 3};
  auto bytes = encode(d);
  // Layout: header 12, transfer_id 16, compat 27, hash 8, num_tokens 4, timeout 4, present 4,
  // then the count.
  const std::size_t count_at = 12 + 16 + 27 + 8 + 4 + 4 + 4;
  ASSERT_EQ(bytes[count_at], 3);
  bytes[count_at] = 0xFF;
  bytes[count_at + 1] = 0xFF;
  bytes[count_at + 2] = 0xFF;
  bytes[count_at + 3] = 0x7F;
  const auto r = decodeKvDescriptor(bytes);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::Corrupt);

  CompletionRecord c;
  c.hidden_state = {1.0F};
  auto cb = encode(c);
  const std::size_t hidden_at = 12 + 16 + 8 + 4 + 4;
  cb[hidden_at + 3] = 0x40;
  EXPECT_EQ(decodeCompletionRecord(cb).error().code, ErrorCode::Corrupt);
}

// present_tokens (protocol 6) names blocks the decode worker shares read-only: a value that is not
// a whole number of the request's blocks short of its last token is refused by the decoder and by
// validateDescriptor, so a hostile one can neither skip the last block nor point past the list.
TEST(KvWire, DescriptorPresentTokensMustBeWholeBlocksShortOfThePrompt) {
  KvDescriptor d;
  d.compat.block_size = 16;
  d.num_tokens = 40;  // 3 blocks
  d.block_ids = {4, 5, 6};
  const auto decodes = [&](std::uint32_t present) {
    KvDescriptor m = d;
    m.present_tokens = present;
    const auto back = decodeKvDescriptor(encode(m));
    if (back.ok()) {
      EXPECT_EQ(back->present_tokens, present);
      return true;
    }
    EXPECT_EQ(back.error().code, ErrorCode::Corrupt) << present;
    return false;
  };
  EXPECT_TRUE(decodes(0));
  EXPECT_TRUE(decodes(16));
  EXPECT_TRUE(decodes(32));
  EXPECT_FALSE(decodes(8));   // not a whole block
  EXPECT_FALSE(decodes(48));  // past the prompt (and its blocks)
  EXPECT_FALSE(decodes(40));  // every token: the prefill worker must write the last one
  EXPECT_FALSE(decodes(0xFFFFFFF0U));
  d.num_tokens = 32;
  EXPECT_FALSE(decodes(32));  // all of a prompt of whole blocks
  d.num_tokens = 100;         // more tokens than the blocks listed: the list bounds it too
  EXPECT_FALSE(decodes(64));
  EXPECT_TRUE(decodes(48));
}

TEST(KvWire, DescriptorCompatHashMustMatchItsFields) {
  KvDescriptor d;
  d.compat.model_hash = 7;
  auto bytes = encode(d);
  const std::size_t model_hash_at = 12 + 16 + 2;
  bytes[model_hash_at] = 8;  // fields changed, hash not
  const auto r = decodeKvDescriptor(bytes);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::Corrupt);
  EXPECT_NE(r.error().message.find("compatibility hash"), std::string::npos) << r.error().message;
}

TEST(KvWire, EnumCodesAreValidated) {
  auto failure = encode(FailureRecord{TransferId{1, 1}, 2, ErrorCode::Timeout, ""});
  failure[12 + 16 + 8] = 200;  // error code
  EXPECT_EQ(decodeFailureRecord(failure).error().code, ErrorCode::Corrupt);

  auto desc = encode(KvDescriptor{});
  desc[12 + 16 + 2 + 8] = 99;  // dtype code (hash check comes after; the dtype is rejected first)
  EXPECT_EQ(decodeKvDescriptor(desc).error().code, ErrorCode::Corrupt);

  CompletionRecord c;
  auto comp = encode(c);
  comp[12 + 16 + 8 + 4 + 4 + 4] = 2;  // logprob flag
  const auto r = decodeCompletionRecord(comp);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("logprob flag"), std::string::npos);
}

TEST(KvWire, CompatHashCoversEveryField) {
  const CompatInfo base;
  std::vector<CompatInfo> variants(7, base);
  variants[0].protocol_version += 1;
  variants[1].model_hash += 1;
  variants[2].kv_dtype = DType::F32;
  variants[3].block_size += 1;
  variants[4].num_layers += 1;
  variants[5].kv_dim += 1;
  variants[6].tp_size += 1;
  const char* names[] = {"protocol_version", "model_hash", "kv_dtype", "block_size", "num_layers", "kv_dim", "tp_size"};
  for (std::size_t i = 0; i < variants.size(); ++i) {
    EXPECT_NE(compatHash(variants[i]), compatHash(base)) << names[i];
    const Status s = checkCompatible(base, variants[i]);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::Unsupported);
    EXPECT_NE(s.error().message.find(names[i]), std::string::npos) << s.error().message;
  }
  EXPECT_TRUE(checkCompatible(base, base).ok());
  EXPECT_EQ(base.tokenBytes(), 1152U);  // 576 BF16 values
}

// The CI stand-in for the libFuzzer target: seeded random buffers (with and without a valid
// header) and mutations of valid messages through the same oracle.
TEST(KvWire, SeededRandomAndMutatedInputsKeepTheDecoderContract) {
  std::mt19937_64 rng(20241129);
  int decoded = 0;
  for (int i = 0; i < 6000; ++i) {
    std::vector<std::uint8_t> bytes;
    switch (i % 4) {
      case 0: {  // random bytes
        bytes.resize(rng() % 200);
        for (auto& b : bytes) b = static_cast<std::uint8_t>(rng());
        break;
      }
      case 1: {  // a valid header over a random payload
        bytes.resize(kWireHeaderBytes + rng() % 200);
        for (auto& b : bytes) b = static_cast<std::uint8_t>(rng());
        const std::uint32_t len = static_cast<std::uint32_t>(bytes.size() - kWireHeaderBytes);
        const std::uint8_t type = static_cast<std::uint8_t>(1 + rng() % 3);
        std::memcpy(bytes.data(), &kWireMagic, 4);
        std::memcpy(bytes.data() + 4, &kProtocolVersion, 2);
        bytes[6] = type;
        bytes[7] = 0;
        std::memcpy(bytes.data() + 8, &len, 4);
        break;
      }
      default: {  // mutate a valid message: flips, overwrites, splices, truncation
        bytes = validMessage(rng);
        for (int m = 0, n = 1 + static_cast<int>(rng() % 4); m < n && !bytes.empty(); ++m) {
          const std::size_t at = rng() % bytes.size();
          switch (rng() % 4) {
            case 0:
              bytes[at] ^= static_cast<std::uint8_t>(1U << (rng() % 8));
              break;
            case 1:
              bytes[at] = static_cast<std::uint8_t>(rng());
              break;
            case 2:
              bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(at), static_cast<std::uint8_t>(rng()));
              break;
            default:
              bytes.resize(at);
              break;
          }
        }
        break;
      }
    }
    const std::string problem = fuzz::checkKvWireInput(bytes);
    ASSERT_TRUE(problem.empty()) << "input " << i << ": " << problem;
    if (decodeRecord(bytes).ok() || decodeKvDescriptor(bytes).ok()) ++decoded;
  }
  // Some mutations (e.g. of a float or an id) stay valid: the oracle's re-encode check ran.
  EXPECT_GT(decoded, 100);
}

// ---- UCX blob checks ------------------------------------------------------------------------------

std::string addressError(const std::vector<std::uint8_t>& a) {
  const Status s = fuzz::referenceBlobCheck().checkWorkerAddress(a);
  return s.ok() ? std::string() : s.error().message;
}
std::string rkeyError(const std::vector<std::uint8_t>& k) {
  const Status s = fuzz::referenceBlobCheck().checkRemoteKey(k);
  return s.ok() ? std::string() : s.error().message;
}

TEST(UcxBlobCheck, ItsOwnAddressAndKeyPass) {
  EXPECT_EQ(addressError(fuzz::referenceUcxAddress()), "");
  EXPECT_EQ(rkeyError(fuzz::referenceUcxRkey()), "");
}

TEST(UcxBlobCheck, AnotherHeaderIsRefusedBeforeUcxCouldAssertOnIt) {
  for (const std::uint8_t flip : {0x01, 0x02, 0x0f, 0x10, 0x80}) {
    auto a = fuzz::referenceUcxAddress();
    a[0] ^= flip;
    EXPECT_NE(addressError(a).find("header"), std::string::npos) << int{flip} << ": " << addressError(a);
  }
  EXPECT_NE(addressError({}).find("header"), std::string::npos);
}

TEST(UcxBlobCheck, EveryTruncationAndAnyTrailingByteIsRefused) {
  const auto a = fuzz::referenceUcxAddress();
  for (std::size_t n = 0; n < a.size(); ++n) {
    EXPECT_NE(addressError({a.begin(), a.begin() + static_cast<std::ptrdiff_t>(n)}), "") << n;
  }
  auto longer = a;
  longer.push_back(0);
  EXPECT_NE(addressError(longer).find("1 bytes after the last device"), std::string::npos) << addressError(longer);
  const auto k = fuzz::referenceUcxRkey();
  for (std::size_t n = 0; n < k.size(); ++n) {
    EXPECT_NE(rkeyError({k.begin(), k.begin() + static_cast<std::ptrdiff_t>(n)}), "") << n;
  }
  auto key = k;
  key.push_back(0);
  EXPECT_NE(rkeyError(key).find("after the last memory domain"), std::string::npos) << rkeyError(key);
}

TEST(UcxBlobCheck, LengthsThatPointPastTheEndAreRefused) {
  auto a = fuzz::referenceUcxAddress();
  a[10] = 0x80 | 0x1f;  // device address length 31: past the end
  EXPECT_NE(addressError(a).find("truncated"), std::string::npos) << addressError(a);
  a = fuzz::referenceUcxAddress();
  a[10] &= 0x7f;  // not the last device: the walk runs off the end looking for the next one
  EXPECT_NE(addressError(a).find("truncated"), std::string::npos) << addressError(a);
  a = fuzz::referenceUcxAddress();
  a[15 + 2 + 16] = 0x40 | 0x80 | 6;  // endpoint addresses never appear in a worker address
  EXPECT_NE(addressError(a).find("endpoint addresses"), std::string::npos) << addressError(a);
  a = fuzz::referenceUcxAddress();
  a[9] = 0xff;  // the "no transports" marker
  EXPECT_NE(addressError(a).find("no transports"), std::string::npos) << addressError(a);
}

TEST(UcxBlobCheck, InterfaceAttributesMustBeInRangeAndClaimOnlyThisUcxsCapabilities) {
  const std::size_t attr = 17;  // after header, uuid, device and transport checksum
  for (const float bad : {-1.0F, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    for (const std::size_t field : {0, 4, 8}) {
      auto a = fuzz::referenceUcxAddress();
      std::memcpy(a.data() + attr + field, &bad, sizeof(bad));
      EXPECT_NE(addressError(a).find("attributes out of range"), std::string::npos) << field << ": " << addressError(a);
    }
  }
  auto a = fuzz::referenceUcxAddress();
  a[attr + 13] ^= 0x40;  // one more capability flag for transport 0x1234
  EXPECT_NE(addressError(a).find("claims capabilities"), std::string::npos) << addressError(a);
  a = fuzz::referenceUcxAddress();
  a[attr + 12] ^= 0x07;  // the priority byte may differ
  EXPECT_EQ(addressError(a), "");
  a = fuzz::referenceUcxAddress();
  a[15] ^= 0x01;  // a transport this UCX does not have: UCX never selects it
  EXPECT_EQ(addressError(a), "");
}

TEST(UcxBlobCheck, RemoteKeysMustMatchThisUcxsMemoryDomainsAndSizes) {
  auto k = fuzz::referenceUcxRkey();
  k[0] |= 0x02;    // MD 1: not among this UCX's
  k.push_back(0);  // its (empty) key
  EXPECT_NE(rkeyError(k).find("memory domains 0x2"), std::string::npos) << rkeyError(k);
  k = fuzz::referenceUcxRkey();
  k[8] = 1;  // another memory type
  EXPECT_NE(rkeyError(k).find("memory type"), std::string::npos) << rkeyError(k);
  k = fuzz::referenceUcxRkey();
  k[9] = 1;  // MD 0's key is one byte, ours is empty
  k.push_back(0);
  EXPECT_NE(rkeyError(k).find("memory domain 0's key is 1 bytes"), std::string::npos) << rkeyError(k);
  k = fuzz::referenceUcxRkey();
  k[0] = 0x01;  // a subset of our MDs is fine (a peer may have fewer)
  k.pop_back();
  EXPECT_EQ(rkeyError(k), "");
}

TEST(UcxBlobCheck, UnknownOwnFormatsFailClosed) {
  auto own = fuzz::referenceUcxAddress();
  own[0] = 0x27;  // version 7
  auto made = ucx::UcxBlobCheck::create(own, fuzz::referenceUcxRkey());
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.error().code, ErrorCode::Unsupported);
  own = fuzz::referenceUcxAddress();
  own.pop_back();
  EXPECT_FALSE(ucx::UcxBlobCheck::create(own, fuzz::referenceUcxRkey()).ok());
  EXPECT_FALSE(ucx::UcxBlobCheck::create(fuzz::referenceUcxAddress(), std::vector<std::uint8_t>{1, 2}).ok());
}

TEST(UcxBlobCheck, SeededMutationsOfAnAddressAndAKeyKeepTheCheckContract) {
  std::mt19937_64 rng(2121);
  int accepted = 0;
  for (int i = 0; i < 4000; ++i) {
    auto bytes = (i % 2 == 0) ? fuzz::referenceUcxAddress() : fuzz::referenceUcxRkey();
    for (int m = 0, n = 1 + static_cast<int>(rng() % 3); m < n && !bytes.empty(); ++m) {
      const std::size_t at = rng() % bytes.size();
      switch (rng() % 4) {
        case 0:
          bytes[at] ^= static_cast<std::uint8_t>(1U << (rng() % 8));
          break;
        case 1:
          bytes[at] = static_cast<std::uint8_t>(rng());
          break;
        case 2:
          bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(at), static_cast<std::uint8_t>(rng()));
          break;
        default:
          bytes.resize(at);
          break;
      }
    }
    const std::string problem = fuzz::checkUcxBlobs(bytes);
    ASSERT_TRUE(problem.empty()) << "input " << i << ": " << problem;
    if (fuzz::referenceBlobCheck().checkWorkerAddress(bytes).ok() ||
        fuzz::referenceBlobCheck().checkRemoteKey(bytes).ok()) {
      ++accepted;
    }
  }
  // Mutations of payload bytes (uuid, attributes, addresses) stay well-formed: the prefix
  // property ran on accepted blobs.
  EXPECT_GT(accepted, 100);
}

}  // namespace
}  // namespace pd::kvtransfer
