#pragma once
/// Latent-KV layout arithmetic (DESIGN.md §4, docs/kv-transfer.md "Layout"): which bytes of a
/// decode rank's KV regions hold token t of layer l, and how a layer's contiguous run of tokens on
/// the prefill side splits into puts. Shared by every Transport so they agree byte for byte.
///
/// Thread rules: pure functions; thread-safe.

#include <cstdint>
#include <vector>

#include "pd/common/result.h"
#include "pd/kvtransfer/wire.h"

namespace pd::kvtransfer {

/// Checks what a sender must know before writing anything: supported dtype, a block list that
/// covers num_tokens (a target's own list, KvTarget::block_ids, as long as the descriptor's), at
/// least one target, distinct tp ranks below tp_size, every layer covered by
/// exactly one region per target, and every byte a put could touch inside its region (overflow
/// checked). InvalidArgument naming the field otherwise.
[[nodiscard]] Status validateDescriptor(const KvDescriptor& descriptor);

/// One contiguous copy: `length` bytes from `local_offset` (relative to the first token of the
/// LayerSlice) to `remote_address` inside region `region_index` of the target.
struct PlannedPut {
  std::uint32_t region_index = 0;
  std::uint64_t remote_address = 0;
  std::uint64_t local_offset = 0;
  std::uint64_t length = 0;
  friend bool operator==(const PlannedPut&, const PlannedPut&) = default;
};

/// Tokens [first_token, first_token + num_tokens) of one layer, stored contiguously on the
/// sending side at tokenBytes() per token.
struct LayerSlice {
  std::uint32_t layer = 0;
  std::uint32_t first_token = 0;
  std::uint32_t num_tokens = 0;
};

/// Splits `slice` into puts for target `target_index` of a validated descriptor, at that target's
/// block ids (targetBlockIds). Runs that are
/// contiguous on both sides (consecutive block ids, block_stride == block_size * token bytes) are
/// merged into one put. InvalidArgument when the slice is outside the descriptor.
[[nodiscard]] Result<std::vector<PlannedPut>> planLayerPuts(const KvDescriptor& descriptor, std::size_t target_index,
                                                            const LayerSlice& slice);

/// Bytes one request puts per target: (num_tokens - present_tokens) * num_layers * tokenBytes().
[[nodiscard]] std::uint64_t requestKvBytes(const KvDescriptor& descriptor);

}  // namespace pd::kvtransfer
