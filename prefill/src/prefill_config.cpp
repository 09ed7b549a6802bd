#include "pd/prefill/prefill_config.h"

#include <fmt/format.h>

namespace pd::prefill {

void registerOptions(config::OptionSet& set, PrefillConfig& cfg) {
  set.add("host", &cfg.host, "address the prefill control endpoint binds")
      .add("port", &cfg.port, "control port (0 = any free port)", 0, 65535)
      .add("chunk_size", &cfg.chunk_size, "prompt tokens per prefill chunk", 1, 1 << 20)
      .add("token_budget", &cfg.token_budget, "prompt tokens per forward, across requests", 1, 1 << 24)
      .add("max_queued_requests", &cfg.max_queued_requests, "queued prompts before refusing", 1, 1 << 20)
      .add("request_timeout_ms", &cfg.request_timeout_ms, "deadline for one prefill incl. KV transfer", 100, 86400000)
      .add("cache_blocks", &cfg.cache_blocks, "blocks of the prefill-local latent cache (bounds prompts in flight)", 1,
           1 << 24)
      .add("cache_block_size", &cfg.cache_block_size, "tokens per block of the prefill-local latent cache", 1, 1 << 16)
      .add("kv_dtype", &cfg.kv_dtype,
           "element type of the prefill-local latent cache (bf16: later chunks attend to the earlier ones rounded as "
           "a BF16 decode pool holds them; fp8 likewise for an FP8 pool)",
           {"f32", "bf16", "fp8"})
      .add("prefix_cache_blocks", &cfg.prefix_cache_blocks,
           "local cache blocks kept for prompt-prefix reuse, LRU-evicted; beyond cache_blocks means cache_blocks (0: "
           "off)",
           0, 1 << 24)
      .add("drain_timeout_ms", &cfg.drain_timeout_ms,
           "on SIGTERM/SIGINT, how long in-flight prefills may finish before they are aborted", 0, 86400000)
      .add("threads", &cfg.threads, "compute threads of the model engine (0: every hardware thread)", 0, 1024)
      .add("io_threads", &cfg.io_threads, "HTTP server threads of the internal API", 1, 64)
      .add("tensor_parallel", &cfg.tensor_parallel, "tensor-parallel ranks (processes on this machine)", 1, 64)
      .add("tp_rank", &cfg.tp_rank, "tensor-parallel rank of a spawned process (set by rank 0)", 0, 63)
      .add("tp_group", &cfg.tp_group, "shared-memory name of the tensor-parallel group (set by rank 0)");
}

Status validate(const PrefillConfig& cfg) {
  if (cfg.tp_rank >= cfg.tensor_parallel) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("prefill.tp_rank {} must be below prefill.tensor_parallel {}", cfg.tp_rank, cfg.tensor_parallel));
  }
  if (cfg.tp_rank > 0 && cfg.tp_group.empty()) {
    return makeError(ErrorCode::InvalidArgument,
                     "prefill.tp_rank > 0 (a spawned tensor-parallel rank) needs prefill.tp_group; such ranks are "
                     "started by rank 0 (prefill.tensor_parallel > 1), not by hand");
  }
  return okStatus();
}

}  // namespace pd::prefill
