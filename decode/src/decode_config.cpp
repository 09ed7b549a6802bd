#include "pd/decode/decode_config.h"

namespace pd::decode {

void registerOptions(config::OptionSet& set, DecodeConfig& cfg) {
  set.add("host", &cfg.host, "address the decode control endpoint binds")
      .add("port", &cfg.port, "control port (0 = any free port)", 0, 65535)
      .add("block_size", &cfg.block_size, "tokens per latent-KV block", 1, 4096)
      .add("num_blocks", &cfg.num_blocks, "latent-KV blocks per layer in the pool", 1, 1 << 24)
      .add("max_running_requests", &cfg.max_running_requests, "sequences in one decode batch", 1, 1 << 16)
      .add("num_speculative_tokens", &cfg.num_speculative_tokens, "MTP draft tokens per step (0 = off)", 0, 8)
      .add("tensor_parallel", &cfg.tensor_parallel, "tensor-parallel ranks", 1, 64)
      .add("kv_wait_timeout_ms", &cfg.kv_wait_timeout_ms, "how long an admitted request waits for its KV", 100,
           86400000);
}

}  // namespace pd::decode
