#pragma once
/// A whole prefill worker process (`pdserve prefill`): loads the model, serves the internal API
/// (docs/internal-api.md) through PrefillServer, reports once it serves, and drains on SIGTERM /
/// SIGINT: /ready turns 503 and new prefills are refused at once, in-flight ones may finish for
/// prefill.drain_timeout_ms, the rest are aborted (failure records to their decode workers). A
/// second signal skips the wait.
///
/// Tensor parallelism (docs/tensor-parallel.md): with prefill.tensor_parallel N > 1 this process
/// is rank 0: it spawns ranks 1..N-1 (`rank_argv` plus --prefill.tp_rank r --prefill.tp_group
/// NAME) joined over shared memory, wraps its shard in a TpLeaderEngine and serves; every forward
/// runs sharded on all ranks, and rank 0's sink streams the (replicated) latent KV. A spawned rank
/// (prefill.tp_rank > 0) reports nothing, ignores SIGTERM / SIGINT and returns once rank 0 stops
/// the group. A rank that exits breaks the group: prefills fail with PeerFailed (the router
/// retries elsewhere) and /ready answers 503.
///
/// Thread rules: call runWorker() on the process's main thread before any other thread exists
/// (it blocks SIGTERM and SIGINT to take them synchronously); it blocks until the worker stopped.

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/gpu.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/prefill/prefill_config.h"
#include "pd/trace/trace_config.h"

namespace pd::prefill {

struct PrefillWorkerConfig {
  PrefillConfig prefill;
  kvtransfer::KvTransferConfig kvtransfer;
  /// The model folder (resolved: the embedded default model is already written out).
  std::filesystem::path model_dir;
  /// The folder of the tokenizer whose vocabulary output constraints compile against (the
  /// router's); empty: model_dir. Without a loadable tokenizer the worker serves free text only.
  std::filesystem::path tokenizer_dir;
  /// The command line that starts another rank of this worker (executable, subcommand, flags);
  /// rank 0 appends each spawned rank's --prefill.tp_rank / --prefill.tp_group to it.
  std::vector<std::string> rank_argv;
  /// Called once when the worker serves, with its readiness fields ("role=prefill url=http://...");
  /// the command prints them on its PDSERVE_READY line. Not called on spawned ranks.
  std::function<void(const std::string& fields)> on_ready;
  /// The cluster secret file (docs/security.md); empty: an unauthenticated internal plane.
  std::filesystem::path cluster_secret_file;
  /// The `trace:` section (docs/observability.md).
  trace::TraceConfig trace;
  /// Where the model runs (`model.device`): the CPU engine, or the CUDA engine on one device
  /// (tensor parallelism needs the CPU engine). With CUDA every rank of a tensor-parallel group
  /// also joins an NCCL communicator on its device index + its rank on this machine
  /// (comm::joinDeviceGroup, docs/tensor-parallel.md "NCCL").
  gpu::ModelDevice model_device;
  /// `model.batch_invariant`: the engine of every rank computes a token alike whatever its batch
  /// or chunk (model::CpuEngineOptions::batch_invariant; docs/engine.md "Batch-invariant mode").
  bool batch_invariant = false;
  /// `model.numerics`: the CUDA engine's numerics (model::CudaEngineOptions::numerics).
  gpu::Numerics numerics = gpu::Numerics::Fp32;
  /// `model.cuda_graphs` (model::CudaEngineOptions::cuda_graphs).
  bool cuda_graphs = true;
};

/// Cross-field checks of the whole worker configuration (InvalidArgument naming the values).
[[nodiscard]] Status validate(const PrefillWorkerConfig& cfg);

/// Runs the worker (or, for prefill.tp_rank > 0, the spawned rank) until it is stopped: ok after
/// a drain (or after rank 0 stopped the group), an error when it could not start or its group
/// failed.
[[nodiscard]] Status runWorker(const PrefillWorkerConfig& cfg);

}  // namespace pd::prefill
