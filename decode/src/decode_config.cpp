#include "pd/decode/decode_config.h"

#include <fmt/format.h>

#include "pd/comm/tcp_communicator.h"

namespace pd::decode {

void registerOptions(config::OptionSet& set, DecodeConfig& cfg) {
  set.add("host", &cfg.host, "address the decode control endpoint binds")
      .add("port", &cfg.port, "control port (0 = any free port)", 0, 65535)
      .add("block_size", &cfg.block_size, "tokens per latent-KV block", 1, 4096)
      .add("num_blocks", &cfg.num_blocks,
           "latent-KV blocks per layer in the pool (0: 1024 on the CPU, what model.gpu_memory_utilization leaves on "
           "a GPU)",
           0, 1 << 24)
      .add("max_running_requests", &cfg.max_running_requests, "sequences in one decode batch", 1, 1 << 16)
      .add("kv_headroom_blocks", &cfg.kv_headroom_blocks,
           "KV blocks an admission must leave free for running requests to grow into (then preemption)", 0, 1 << 24)
      .add("num_speculative_tokens", &cfg.num_speculative_tokens, "MTP draft tokens per step (0 = off)", 0, 8)
      .add("local_prefill_max_tokens", &cfg.local_prefill_max_tokens,
           "longest prompt this worker prefills itself when the router asks (0 = never)", 0, 1 << 24)
      .add("local_prefill_chunk_size", &cfg.local_prefill_chunk_size,
           "prompt tokens per forward of a local prefill (the prefill workers' chunk_size gives identical KV)", 1,
           1 << 20)
      .add("local_prefill_token_budget", &cfg.local_prefill_token_budget,
           "prompt tokens prefilled locally between two decode steps (at least one prompt)", 1, 1 << 24)
      .add("prefix_cache_blocks", &cfg.prefix_cache_blocks,
           "pool blocks of finished prompts kept for later turns' prefix reuse (0 = off)", 0, 1 << 24)
      .add("overlap_steps", &cfg.overlap_steps,
           "run each step's forwards beside the loop that admits requests, takes KV arrivals and streams first "
           "tokens")
      .add("tensor_parallel", &cfg.tensor_parallel, "tensor-parallel ranks", 1, 64)
      .add("nnodes", &cfg.nnodes, "machines the tensor-parallel group spans (> 1 needs dist_init_address)", 1, 64)
      .add("node_rank", &cfg.node_rank, "this machine's index in the tensor-parallel group (0 serves the API)", 0, 63)
      .add("dist_init_address", &cfg.dist_init_address,
           "host:port of node 0's tensor-parallel rendezvous (TCP); empty: one machine, shared memory")
      .add("tp_rank", &cfg.tp_rank, "tensor-parallel rank of a spawned process (set by its parent)", 0, 63)
      .add("tp_group", &cfg.tp_group, "shared-memory name of the tensor-parallel group (set by the leader)")
      .add("tp_inject_latency_us", &cfg.tp_inject_latency_us,
           "TEST-ONLY: latency added to every tensor-parallel message (emulates a network; 0 = off)", 0, 1000000)
      .add("kv_wait_timeout_ms", &cfg.kv_wait_timeout_ms,
           "longest an admitted request waits for its KV (a request's kv_timeout_ms is clamped to it)", 100, 86400000)
      .add("kv_dtype", &cfg.kv_dtype,
           "element type of the latent-KV pool (fp8: e4m3 with a scale per 64 values, half of bf16's bytes)",
           {"bf16", "f32", "fp8"})
      .add("threads", &cfg.threads, "model engine compute threads (0 = every hardware thread)", 0, 1024)
      .add("http_threads", &cfg.http_threads, "io threads of the internal HTTP API", 1, 64)
      .add("drain_timeout_ms", &cfg.drain_timeout_ms,
           "on SIGTERM, how long in-flight requests may finish before the rest are aborted", 0, 86400000);
}

Status validate(const DecodeConfig& cfg) {
  const auto bad = [](std::string message) { return makeError(ErrorCode::InvalidArgument, std::move(message)); };
  if (cfg.tp_rank >= cfg.tensor_parallel) {
    return bad(
        fmt::format("decode.tp_rank {} must be below decode.tensor_parallel {}", cfg.tp_rank, cfg.tensor_parallel));
  }
  if (cfg.tensor_parallel % cfg.nnodes != 0) {
    return bad(
        fmt::format("decode.tensor_parallel {} must be a multiple of decode.nnodes {} (the same ranks on "
                    "every node)",
                    cfg.tensor_parallel, cfg.nnodes));
  }
  if (cfg.node_rank >= cfg.nnodes) {
    return bad(fmt::format("decode.node_rank {} must be below decode.nnodes {}", cfg.node_rank, cfg.nnodes));
  }
  if (cfg.nnodes > 1 && cfg.dist_init_address.empty()) {
    return bad("decode.nnodes > 1 needs decode.dist_init_address (node 0's host:port)");
  }
  if (!cfg.dist_init_address.empty()) {
    auto where = comm::parseHostPort(cfg.dist_init_address);
    if (!where.ok()) return std::move(where).error();
    if (where->port == 0) return bad("decode.dist_init_address needs a port (the other nodes must know it)");
  }
  if (cfg.tp_rank > 0 && cfg.tp_group.empty() && cfg.dist_init_address.empty()) {
    return bad(
        "decode.tp_rank > 0 (a spawned tensor-parallel rank) needs decode.tp_group or "
        "decode.dist_init_address; such ranks are started by their node's process "
        "(decode.tensor_parallel > 1), not by hand");
  }
  return okStatus();
}

}  // namespace pd::decode
