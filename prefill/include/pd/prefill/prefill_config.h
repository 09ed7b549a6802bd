#pragma once
/// Prefill worker settings (section `prefill:`). Thread rules: filled once in main, then read-only.

#include <cstdint>
#include <string>

#include "pd/common/config.h"
#include "pd/common/result.h"

namespace pd::prefill {

struct PrefillConfig {
  std::string host = "127.0.0.1";
  std::int64_t port = 0;
  std::int64_t chunk_size = 512;
  std::int64_t token_budget = 2048;
  std::int64_t max_queued_requests = 256;
  std::int64_t request_timeout_ms = 120000;
  std::int64_t cache_blocks = 512;     ///< prefill-local latent cache, in blocks
  std::int64_t cache_block_size = 64;  ///< tokens per prefill-local cache block
  /// Element type of the prefill-local latent cache ("f32" or "bf16"). A later chunk attends to
  /// the earlier ones as this cache holds them; "bf16" rounds them as a BF16 decode pool does
  /// (and halves the cache's memory), which batch-invariant serving with BF16 pools needs.
  std::string kv_dtype = "f32";
  /// Blocks of the local cache the prefix cache may keep for reuse (0: off); values above cache_blocks mean
  /// cache_blocks.
  std::int64_t prefix_cache_blocks = 256;
  std::int64_t drain_timeout_ms = 30000;  ///< SIGTERM: how long in-flight requests may finish
  std::int64_t threads = 0;               ///< compute threads of the model engine (0: every hardware thread)
  std::int64_t io_threads = 2;            ///< HTTP server threads
  /// Tensor-parallel ranks on this machine (docs/tensor-parallel.md): this process is rank 0 and
  /// spawns ranks 1.. (its own command line plus tp_rank / tp_group); every rank computes its
  /// shard of each forward, rank 0 streams the (replicated) latent KV.
  std::int64_t tensor_parallel = 1;
  std::int64_t tp_rank = 0;  ///< a spawned rank's rank (set by rank 0, never by hand)
  std::string tp_group;      ///< the group's shared-memory name (set by rank 0)
};

void registerOptions(config::OptionSet& set, PrefillConfig& cfg);

/// What the option table alone cannot check: values that must agree with each other
/// (InvalidArgument naming them).
[[nodiscard]] Status validate(const PrefillConfig& cfg);

}  // namespace pd::prefill
