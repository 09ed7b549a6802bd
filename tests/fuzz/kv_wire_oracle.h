#pragma once
// The property every KV wire decoder must keep on any input, shared by the libFuzzer target
// (fuzz_kv_wire.cpp) and the seeded gtest that runs in CI (test_kv_wire.cpp):
//  - no crash, no read outside the input (ASan in the fuzz build);
//  - a buffer that decodes re-encodes to the same bytes (the encoding is canonical);
//  - a descriptor that also passes validateDescriptor only ever plans puts inside its regions.
// Thread rules: pure function.

#include <fmt/format.h>

#include <cstdint>
#include <span>
#include <string>
#include <variant>

#include "pd/kvtransfer/layout.h"
#include "pd/kvtransfer/wire.h"

namespace pd::kvtransfer::fuzz {

/// Empty when `bytes` is handled correctly by every decoder, else what went wrong.
inline std::string checkKvWireInput(std::span<const std::uint8_t> bytes) {
  (void)peekMessageType(bytes);

  if (auto d = decodeKvDescriptor(bytes); d.ok()) {
    if (encode(d.value()) != std::vector<std::uint8_t>(bytes.begin(), bytes.end())) {
      return "KV descriptor does not re-encode to its input";
    }
    if (validateDescriptor(d.value()).ok()) {
      const auto& desc = d.value();
      const std::uint32_t layers[] = {0, desc.compat.num_layers / 2, desc.compat.num_layers - 1};
      for (std::size_t ti = 0; ti < desc.targets.size(); ++ti) {
        for (const std::uint32_t layer : layers) {
          auto puts = planLayerPuts(desc, ti, LayerSlice{layer, 0, desc.num_tokens});
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
  if (completion.ok() && encode(completion.value()) != std::vector<std::uint8_t>(bytes.begin(), bytes.end())) {
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
