#pragma once
// The property every KV wire decoder must keep on any input, shared by the libFuzzer target
// (fuzz_kv_wire.cpp) and the seeded gtest that runs in CI (test_kv_wire.cpp):
//  - no crash, no read outside the input (ASan in the fuzz build);
//  - a buffer that decodes re-encodes to the same bytes (the encoding is canonical), except a
//    completion record whose traceparent was dropped, which re-encodes without it;
//  - a descriptor that also passes validateDescriptor only ever plans puts inside its regions;
//  - the UCX blob checks (ucx_blob_check.h) never read outside their input, and accept no proper
//    prefix of a blob they accept (UCX itself would read such an address or key past its end).
//    They run on every decoded descriptor's addresses and keys and on the raw input itself,
//    against a synthetic reference address and key shaped like UCX 1.13's.
// Thread rules: pure functions.

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <variant>

#include "pd/kvtransfer/layout.h"
#include "pd/kvtransfer/wire.h"
#include "ucx/ucx_blob_check.h"

namespace pd::kvtransfer::fuzz {

/// A UCX 1.13 v1 worker address: header (uuid flag), uuid, one device (md 0, a 4-byte device
/// address) with one interface (transport 0x1234, 16 attribute bytes: overhead, bandwidth and
/// latency as floats, priority and capability flags; a 6-byte address).
inline std::vector<std::uint8_t> referenceUcxAddress() {
  std::vector<std::uint8_t> a = {0x20, 1, 2, 3, 4, 5, 6, 7, 8, 0x20, 0x80 | 4, 10, 11, 12, 13, 0x34, 0x12};
  const std::array<float, 3> attr = {5e-5F, 1.2e7F, 1e-5F};
  const std::uint32_t prio_cap_flags = 0x00a31d02;
  a.resize(a.size() + 16);
  std::memcpy(a.data() + a.size() - 16, attr.data(), 12);
  std::memcpy(a.data() + a.size() - 4, &prio_cap_flags, 4);
  a.push_back(0x80 | 6);
  a.insert(a.end(), 6, 0x07);
  return a;
}
/// A packed remote key: MDs 0 and 3 with empty keys, host memory.
inline std::vector<std::uint8_t> referenceUcxRkey() {
  return {0x09, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
}

inline const ucx::UcxBlobCheck& referenceBlobCheck() {
  static const ucx::UcxBlobCheck check = ucx::UcxBlobCheck::create(referenceUcxAddress(), referenceUcxRkey()).value();
  return check;
}

/// Empty when the blob checks handle `bytes` (as an address and as a key) correctly.
inline std::string checkUcxBlobs(std::span<const std::uint8_t> bytes) {
  const auto& check = referenceBlobCheck();
  const Status address = check.checkWorkerAddress(bytes);
  if (!address.ok() && address.error().code != ErrorCode::InvalidArgument) {
    return "address check returned " + address.error().toString();
  }
  const Status rkey = check.checkRemoteKey(bytes);
  if (!rkey.ok() && rkey.error().code != ErrorCode::InvalidArgument) {
    return "remote key check returned " + rkey.error().toString();
  }
  if (bytes.size() <= 512) {
    for (std::size_t n = 0; n < bytes.size(); ++n) {
      if (address.ok() && check.checkWorkerAddress(bytes.first(n)).ok()) {
        return fmt::format("an accepted {}-byte address's {}-byte prefix is accepted too", bytes.size(), n);
      }
      if (rkey.ok() && check.checkRemoteKey(bytes.first(n)).ok()) {
        return fmt::format("an accepted {}-byte remote key's {}-byte prefix is accepted too", bytes.size(), n);
      }
    }
  }
  return {};
}

/// Empty when `bytes` is handled correctly by every decoder, else what went wrong.
inline std::string checkKvWireInput(std::span<const std::uint8_t> bytes) {
  (void)peekMessageType(bytes);
  if (std::string problem = checkUcxBlobs(bytes); !problem.empty()) return problem;

  if (auto d = decodeKvDescriptor(bytes); d.ok()) {
    if (encode(d.value()) != std::vector<std::uint8_t>(bytes.begin(), bytes.end())) {
      return "KV descriptor does not re-encode to its input";
    }
    for (const auto& target : d.value().targets) {
      if (std::string problem = checkUcxBlobs(target.worker_address); !problem.empty()) return problem;
      for (const auto& region : target.regions) {
        if (std::string problem = checkUcxBlobs(region.rkey); !problem.empty()) return problem;
      }
    }
    if (validateDescriptor(d.value()).ok()) {
      const auto& desc = d.value();
      const std::uint32_t layers[] = {0, desc.compat.num_layers / 2, desc.compat.num_layers - 1};
      for (std::size_t ti = 0; ti < desc.targets.size(); ++ti) {
        for (const std::uint32_t layer : layers) {
          // The tokens the decode worker does not hold yet (all of them without present_tokens).
          auto puts =
              planLayerPuts(desc, ti, LayerSlice{layer, desc.present_tokens, desc.num_tokens - desc.present_tokens});
          if (!puts.ok()) return "a validated descriptor refused a slice inside it: " + puts.error().message;
          for (const auto& p : puts.value()) {
            const auto& r = desc.targets[ti].regions[p.region_index];
            if (p.remote_address < r.base_address || p.remote_address - r.base_address > r.length ||
                p.length > r.length - (p.remote_address - r.base_address)) {
              return fmt::format("planned put [{}, +{}) is outside region [{}, +{})", p.remote_address, p.length,
                                 r.base_address, r.length);
            }
          }
        }
      }
    }
  } else if (d.error().code != ErrorCode::Corrupt && d.error().code != ErrorCode::Unsupported) {
    return "KV descriptor decoder returned " + d.error().toString();
  }

  const auto completion = decodeCompletionRecord(bytes);
  if (completion.ok() && completion->traceparent_dropped) {
    // A dropped trace context reads as absent: the record re-encodes without it.
    if (!completion->traceparent.empty()) return "a dropped traceparent is still in the record";
    auto without = decodeCompletionRecord(encode(completion.value()));
    if (!without.ok() || without->traceparent_dropped || !without->traceparent.empty()) {
      return "a record whose traceparent was dropped does not re-encode without it";
    }
  } else if (completion.ok() && encode(completion.value()) != std::vector<std::uint8_t>(bytes.begin(), bytes.end())) {
    return "completion record does not re-encode to its input";
  }
  const auto failure = decodeFailureRecord(bytes);
  if (failure.ok() && encode(failure.value()) != std::vector<std::uint8_t>(bytes.begin(), bytes.end())) {
    return "failure record does not re-encode to its input";
  }
  const auto record = decodeRecord(bytes);
  if (record.ok() != (completion.ok() || failure.ok())) return "decodeRecord disagrees with the typed decoders";
  if (record.ok() && std::holds_alternative<CompletionRecord>(record.value()) != completion.ok()) {
    return "decodeRecord returned the wrong record type";
  }
  return {};
}

}  // namespace pd::kvtransfer::fuzz
