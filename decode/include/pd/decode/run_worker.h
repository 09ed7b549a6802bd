#pragma once
/// A whole decode worker process (`pdserve decode`): loads the model, serves the internal API
/// (docs/internal-api.md) through DecodeServer, reports once it serves, and drains on SIGTERM /
/// SIGINT: /ready turns 503 and new decode streams are refused at once (503 Overloaded), open
/// streams may finish for decode.drain_timeout_ms, the rest are aborted (each ends with an error
/// line; blocks freed, KV expectations cancelled). A second signal skips the wait.
///
/// Tensor parallelism (docs/tensor-parallel.md): with decode.tensor_parallel N > 1 this process is
/// rank 0, the leader: it spawns ranks 1..N-1 (`rank_argv` plus --decode.tp_rank r
/// --decode.tp_group NAME), serves the API and stops the followers when it stops. Across machines
/// (decode.nnodes M > 1, decode.dist_init_address = node 0's host:port) node n's process is rank
/// n*N/M, spawns the next N/M-1 ranks, joins the TCP group at the rendezvous and, on nodes > 0,
/// serves only /health, /ready and /metrics on decode.port (reported as role=decode-rank). Every
/// process but the leader ignores SIGTERM / SIGINT (the leader's drain stops it; it dies with its
/// parent) and returns once the leader stopped the group, with an error when the group failed.
/// While serving, the leader watches the group: a rank that exits or whose connection drops
/// breaks it (requests fail with PeerFailed, /ready answers 503).
///
/// Thread rules: call runWorker() on the process's main thread before any other thread exists
/// (it blocks SIGTERM and SIGINT to take them synchronously); it blocks until the worker stopped.

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/decode/decode_config.h"
#include "pd/engine/gpu.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/trace/trace_config.h"

namespace pd::decode {

struct DecodeWorkerConfig {
  DecodeConfig decode;
  kvtransfer::KvTransferConfig kvtransfer;
  /// The model folder (resolved: the embedded default model is already written out).
  std::filesystem::path model_dir;
  /// The folder of the tokenizer whose vocabulary output constraints compile against (the
  /// router's); empty: model_dir. Without a loadable tokenizer the worker serves free text only.
  std::filesystem::path tokenizer_dir;
  /// The command line that starts another rank of this worker (executable, subcommand, flags);
  /// a node's process appends each spawned rank's --decode.tp_rank (and --decode.tp_group) to it.
  std::vector<std::string> rank_argv;
  /// Called once when the process serves, with its readiness fields ("role=decode url=http://..."
  /// on the leader, "role=decode-rank url=... node_rank=N" on another node's process); the command
  /// prints them on its PDSERVE_READY line. Not called on spawned ranks.
  std::function<void(const std::string& fields)> on_ready;
  /// The cluster secret file (docs/security.md); empty: an unauthenticated internal plane.
  std::filesystem::path cluster_secret_file;
  /// The `trace:` section (docs/observability.md).
  trace::TraceConfig trace;
  /// Where the model runs (`model.device`): the CPU engine, or the CUDA engine. With CUDA every
  /// rank of a tensor-parallel group runs its shard on its device index + its rank on this
  /// machine, over an NCCL communicator (comm::joinDeviceGroup, docs/tensor-parallel.md "NCCL"
  /// and "On GPUs").
  gpu::ModelDevice model_device;
  /// `model.batch_invariant`: the engine of every rank computes a token alike whatever its batch
  /// or chunk (model::CpuEngineOptions::batch_invariant; docs/engine.md "Batch-invariant mode").
  bool batch_invariant = false;
  /// `model.numerics`: the CUDA engine's numerics (model::CudaEngineOptions::numerics).
  gpu::Numerics numerics = gpu::Numerics::Fp32;
  /// `model.cuda_graphs` (model::CudaEngineOptions::cuda_graphs).
  bool cuda_graphs = true;
  /// `model.gpu_memory_utilization`: with CUDA and an automatic decode.num_blocks (0), the pool
  /// gets what this fraction of the GPU leaves (model::planGpuKvPool).
  double gpu_memory_utilization = 0.9;
};

/// Cross-field checks of the whole worker configuration (InvalidArgument naming the values).
[[nodiscard]] Status validate(const DecodeWorkerConfig& cfg);

/// Runs the worker (the leader, another node's process, or a spawned rank, as decode.* says)
/// until it is stopped: ok after a drain (or after the leader stopped the group), an error when it
/// could not start or its group failed.
[[nodiscard]] Status runWorker(const DecodeWorkerConfig& cfg);

}  // namespace pd::decode
