#include "pd/kvtransfer/layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "pd/common/kv_format.h"

namespace pd::kvtransfer {
namespace {

using U128 = unsigned __int128;

constexpr std::uint32_t kMaxLayers = 4096;

Error invalid(std::string message) {
  return makeError(ErrorCode::InvalidArgument, "KV descriptor: " + std::move(message));
}

Status validateTarget(const KvDescriptor& d, std::size_t ti) {
  const auto& t = d.targets[ti];
  const auto& c = d.compat;
  if (t.worker_address.empty()) return invalid(fmt::format("target {} has an empty worker address", ti));
  const std::uint64_t blocks_needed = (std::uint64_t{d.num_tokens} + c.block_size - 1) / c.block_size;
  if (!t.block_ids.empty() && t.block_ids.size() < blocks_needed) {
    return invalid(fmt::format("target {}: {} tokens need {} blocks of {}, its own block list has {}", ti, d.num_tokens,
                               blocks_needed, c.block_size, t.block_ids.size()));
  }
  const std::vector<std::uint32_t>& ids = targetBlockIds(d, t);
  const std::uint32_t max_block_id = *std::max_element(ids.begin(), ids.end());
  if (t.regions.empty()) return invalid(fmt::format("target {} has no regions", ti));
  std::vector<std::size_t> order(t.regions.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return t.regions[a].first_layer < t.regions[b].first_layer; });
  std::uint64_t next_layer = 0;
  const std::uint64_t block_bytes = std::uint64_t{c.block_size} * c.tokenBytes();
  for (const std::size_t ri : order) {
    const auto& r = t.regions[ri];
    const auto where = fmt::format("target {} region {}", ti, ri);
    if (r.num_layers == 0) return invalid(where + " holds no layers");
    if (r.first_layer != next_layer) {
      return invalid(fmt::format("{}: layer {} is {} (each layer must be in exactly one region)", where,
                                 std::min<std::uint64_t>(r.first_layer, next_layer),
                                 r.first_layer > next_layer ? "in no region" : "in two regions"));
    }
    next_layer = std::uint64_t{r.first_layer} + r.num_layers;
    if (next_layer > c.num_layers) {
      return invalid(fmt::format("{} ends at layer {}, the model has {}", where, next_layer, c.num_layers));
    }
    if (r.rkey.empty()) return invalid(where + " has an empty remote key");
    if (r.block_stride < block_bytes) {
      return invalid(
          fmt::format("{}: block stride {} is below one block's {} bytes", where, r.block_stride, block_bytes));
    }
    if (U128{r.base_address} + r.length > U128{UINT64_MAX}) return invalid(where + " wraps the address space");
    const U128 last_byte = U128{r.num_layers - 1U} * r.layer_stride + U128{max_block_id} * r.block_stride + block_bytes;
    if (last_byte > r.length) {
      return invalid(fmt::format("{}: block {} of layer {} ends past the region's {} bytes", where, max_block_id,
                                 r.first_layer + r.num_layers - 1, r.length));
    }
    if (r.num_layers > 1) {
      // The request's blocks of one layer must not overlap another layer's: layer-major (every
      // listed block inside one layer stride) or block-major (all layers inside one block stride).
      const bool layer_major = U128{max_block_id} * r.block_stride + block_bytes <= r.layer_stride;
      const bool block_major =
          r.layer_stride >= block_bytes && U128{r.num_layers} * r.layer_stride <= U128{r.block_stride};
      if (!layer_major && !block_major) {
        return invalid(fmt::format("{}: layer stride {} and block stride {} make layers overlap for block {}", where,
                                   r.layer_stride, r.block_stride, max_block_id));
      }
    }
  }
  if (next_layer != c.num_layers) {
    return invalid(fmt::format("target {}: layers {}..{} are in no region", ti, next_layer, c.num_layers - 1));
  }
  return okStatus();
}

}  // namespace

Status validateDescriptor(const KvDescriptor& d) {
  const auto& c = d.compat;
  if (!isKvDType(c.kv_dtype)) {
    return makeError(
        ErrorCode::Unsupported,
        fmt::format("KV descriptor: KV dtype {} is not supported (BF16, F32, F8_E4M3)", dtypeName(c.kv_dtype)));
  }
  if (c.block_size == 0) return invalid("block_size is 0");
  if (c.kv_dim == 0) return invalid("kv_dim is 0");
  if (c.num_layers == 0 || c.num_layers > kMaxLayers) {
    return invalid(fmt::format("num_layers {} is outside 1..{}", c.num_layers, kMaxLayers));
  }
  if (c.tp_size == 0) return invalid("tp_size is 0");
  if (d.num_tokens == 0) return invalid("num_tokens is 0");
  if (d.timeout_ms == 0) return invalid("timeout_ms is 0");
  const std::uint64_t blocks_needed = (std::uint64_t{d.num_tokens} + c.block_size - 1) / c.block_size;
  if (d.block_ids.size() < blocks_needed) {
    return invalid(fmt::format("{} tokens need {} blocks of {}, the descriptor lists {}", d.num_tokens, blocks_needed,
                               c.block_size, d.block_ids.size()));
  }
  if (d.present_tokens != 0 && (d.present_tokens >= d.num_tokens || d.present_tokens % c.block_size != 0 ||
                                d.present_tokens / c.block_size > d.block_ids.size())) {
    return invalid(fmt::format("present_tokens {} is not a whole number of blocks short of the {} tokens",
                               d.present_tokens, d.num_tokens));
  }
  if (d.targets.empty()) return invalid("no targets");
  if (d.targets.size() > c.tp_size) {
    return invalid(fmt::format("{} targets for tp_size {}", d.targets.size(), c.tp_size));
  }
  std::vector<std::uint32_t> ranks;
  for (std::size_t ti = 0; ti < d.targets.size(); ++ti) {
    const auto rank = d.targets[ti].tp_rank;
    if (rank >= c.tp_size) return invalid(fmt::format("target {} has tp_rank {} >= tp_size {}", ti, rank, c.tp_size));
    ranks.push_back(rank);
  }
  std::sort(ranks.begin(), ranks.end());
  if (const auto dup = std::adjacent_find(ranks.begin(), ranks.end()); dup != ranks.end()) {
    return invalid(fmt::format("tp_rank {} is listed twice", *dup));
  }
  for (std::size_t ti = 0; ti < d.targets.size(); ++ti) PD_TRY(validateTarget(d, ti));
  return okStatus();
}

Result<std::vector<PlannedPut>> planLayerPuts(const KvDescriptor& d, std::size_t target_index, const LayerSlice& s) {
  const auto& c = d.compat;
  if (target_index >= d.targets.size()) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("target {} of {}", target_index, d.targets.size()));
  }
  if (s.layer >= c.num_layers) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("layer {} of {}", s.layer, c.num_layers));
  }
  if (std::uint64_t{s.first_token} + s.num_tokens > d.num_tokens) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("tokens {}..{} past the request's {} tokens", s.first_token,
                                 std::uint64_t{s.first_token} + s.num_tokens, d.num_tokens));
  }
  if (s.num_tokens > 0 && s.first_token < d.present_tokens) {
    // The decode worker's present blocks are shared and read-only (write confinement refuses them).
    return makeError(ErrorCode::InvalidArgument, fmt::format("tokens {}.. are among the {} the decode worker has",
                                                             s.first_token, d.present_tokens));
  }
  const auto& regions = d.targets[target_index].regions;
  const std::vector<std::uint32_t>& block_ids = targetBlockIds(d, d.targets[target_index]);
  const auto it = std::find_if(regions.begin(), regions.end(), [&](const KvRegion& r) {
    return s.layer >= r.first_layer && s.layer - r.first_layer < r.num_layers;
  });
  if (it == regions.end())
    return makeError(ErrorCode::InvalidArgument, fmt::format("layer {} is in no region", s.layer));
  const auto region_index = static_cast<std::uint32_t>(it - regions.begin());
  const std::uint64_t token_bytes = c.tokenBytes();
  const std::uint64_t layer_base = it->base_address + std::uint64_t{s.layer - it->first_layer} * it->layer_stride;

  std::vector<PlannedPut> puts;
  const std::uint64_t end = std::uint64_t{s.first_token} + s.num_tokens;
  for (std::uint64_t t = s.first_token; t < end;) {
    const std::uint64_t block = t / c.block_size;
    const std::uint64_t slot = t % c.block_size;
    const std::uint64_t run = std::min<std::uint64_t>(c.block_size - slot, end - t);
    const PlannedPut p{region_index, layer_base + block_ids[block] * it->block_stride + slot * token_bytes,
                       (t - s.first_token) * token_bytes, run * token_bytes};
    if (!puts.empty() && puts.back().remote_address + puts.back().length == p.remote_address) {
      puts.back().length += p.length;
    } else {
      puts.push_back(p);
    }
    t += run;
  }
  return puts;
}

std::uint64_t requestKvBytes(const KvDescriptor& d) {
  const std::uint32_t sent = d.num_tokens > d.present_tokens ? d.num_tokens - d.present_tokens : 0;
  return std::uint64_t{sent} * d.compat.num_layers * d.compat.tokenBytes();
}

}  // namespace pd::kvtransfer
