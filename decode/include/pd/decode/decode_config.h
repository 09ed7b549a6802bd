#pragma once
/// Decode worker settings (section `decode:`). Thread rules: filled once in main, then read-only.

#include <cstdint>
#include <string>

#include "pd/common/config.h"
#include "pd/common/dtype.h"
#include "pd/common/kv_format.h"
#include "pd/common/result.h"

namespace pd::decode {

struct DecodeConfig {
  std::string host = "127.0.0.1";
  std::int64_t port = 0;
  std::int64_t block_size = 64;
  /// Latent-KV blocks in the pool. 0 (auto): kCpuPoolBlocks on the CPU; with model.device cuda,
  /// what model.gpu_memory_utilization leaves of each GPU after the rank's weights, workspace and
  /// reserves (runWorker, gpu::planKvPool; docs/gpu.md "The GPU memory plan").
  std::int64_t num_blocks = 0;
  std::int64_t max_running_requests = 64;
  /// Blocks an admission leaves free (docs/kv-memory.md): a request is admitted on its prompt's
  /// blocks only if this many stay free after it, room for the running requests to grow before
  /// one must be preempted. Clamped below num_blocks.
  std::int64_t kv_headroom_blocks = 2;
  std::int64_t num_speculative_tokens = 1;
  /// Conditional disaggregation (docs/kv-memory.md, "Local prefill"): the longest prompt this
  /// worker prefills itself when the router asks (0 refuses every local prefill), the prompt
  /// tokens one forward takes (match the prefill workers' chunk_size for identical KV), and the
  /// prompt tokens prefilled between two decode steps.
  std::int64_t local_prefill_max_tokens = 4096;
  std::int64_t local_prefill_chunk_size = 512;
  std::int64_t local_prefill_token_budget = 2048;
  /// Decode-side prefix reuse (docs/kv-memory.md, "Prefix reuse on the decode side"): most pool
  /// blocks of finished prompts kept for later turns (0 = off). Idle cached blocks are given back
  /// before any request is preempted.
  std::int64_t prefix_cache_blocks = 0;
  /// Run each step's forwards on a thread of their own while the loop thread serves admissions,
  /// KV arrivals (with their first tokens) and aborts (docs/kv-memory.md, "Overlapped steps").
  bool overlap_steps = true;
  std::int64_t tensor_parallel = 1;
  /// Machines (pods) the group spans: each runs tensor_parallel / nnodes ranks (docs/tensor-parallel.md,
  /// "Across nodes"). > 1 needs dist_init_address.
  std::int64_t nnodes = 1;
  /// This machine's index in the group: 0 serves the worker's API (the leader, rank 0); node n runs
  /// ranks n * tensor_parallel / nnodes onwards and serves only /health, /ready and /metrics.
  std::int64_t node_rank = 0;
  /// host:port where rank 0 (node 0) listens for the other ranks (TCP communicator). Empty: the
  /// group is on this machine and uses shared memory.
  std::string dist_init_address;
  /// The rank of a process spawned by a node's process (ranks of its node after its own); 0 for the
  /// processes started by hand (docs/tensor-parallel.md), never set by hand.
  std::int64_t tp_rank = 0;
  /// The group's shared-memory name (spawned ranks of a one-machine group; the leader picks it).
  std::string tp_group;
  /// TEST-ONLY: per-message latency (µs) the shm communicator adds to every collective, to emulate
  /// a network between the ranks (tools/bench/netlat_experiment.sh). 0 = off; never in production.
  std::int64_t tp_inject_latency_us = 0;
  /// The longest a request waits for its KV: a DecodeOpen's kv_timeout_ms is clamped to it.
  std::int64_t kv_wait_timeout_ms = 60000;
  /// Element type of the latent-KV pool: "bf16", "f32" or "fp8" (e4m3 with tile scales,
  /// pd/common/kv_format.h).
  std::string kv_dtype = "bf16";
  /// Compute threads of the model engine (0: every hardware thread).
  std::int64_t threads = 0;
  /// HTTP io threads of the internal API.
  std::int64_t http_threads = 2;
  /// On SIGTERM, how long in-flight requests may finish before the rest are aborted.
  std::int64_t drain_timeout_ms = 30000;
};

void registerOptions(config::OptionSet& set, DecodeConfig& cfg);

/// The pool of an automatic decode.num_blocks (0) on the CPU.
inline constexpr std::int64_t kCpuPoolBlocks = 1024;
/// decode.num_blocks, with 0 (auto) as the CPU's kCpuPoolBlocks (a CUDA worker resolves 0 from
/// its memory plan before anything uses it).
[[nodiscard]] inline std::int64_t poolBlocks(const DecodeConfig& cfg) {
  return cfg.num_blocks > 0 ? cfg.num_blocks : kCpuPoolBlocks;
}
/// The pool's element type (decode.kv_dtype: "f32", "bf16" or "fp8").
[[nodiscard]] inline DType poolDtype(const DecodeConfig& cfg) {
  return parseKvDType(cfg.kv_dtype).value_or(DType::BF16);
}

/// What the option table alone cannot check: values that must agree with each other (tensor
/// parallelism across nodes, a spawned rank's group); InvalidArgument naming them.
[[nodiscard]] Status validate(const DecodeConfig& cfg);

}  // namespace pd::decode
