// pdserve up: a whole local cluster (router + prefill + decode workers) on one machine, as child
// processes of this one (tools/cluster: local_cluster.h, cluster_supervisor.h). Workers start first (any free
// port each); the router starts once every worker printed its PDSERVE_READY line, with their
// addresses as its static worker lists. A worker that exits is restarted on its port with backoff
// and a restart budget (up.restart_*); the router's exit or a spent budget stops the cluster and
// `up` exits 1. Ctrl-C / SIGTERM stops the router first (it drains), then the workers; exit 0.
#include <string>
#include <vector>

#include "cli.h"
#include "cluster/local_cluster.h"
#include "pd/common/subprocess.h"
#include "pd/decode/decode_config.h"
#include "pd/engine/gpu.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/prefill/prefill_config.h"
#include "pd/router/router_config.h"

namespace pd::cli {

int runUp(const std::vector<std::string>& raw_args) {
  CommonConfig common;
  cluster::UpConfig up_cfg;
  router::RouterConfig router_cfg;
  prefill::PrefillConfig prefill_cfg;
  decode::DecodeConfig decode_cfg;
  kvtransfer::KvTransferConfig kv_cfg;
  CommonOptions common_sets(common);
  config::OptionSet up_set("up");
  config::OptionSet router_set("router");
  config::OptionSet prefill_set("prefill");
  config::OptionSet decode_set("decode");
  config::OptionSet kv_set("kvtransfer");
  cluster::registerUpOptions(up_set, up_cfg);
  router::registerOptions(router_set, router_cfg);
  prefill::registerOptions(prefill_set, prefill_cfg);
  decode::registerOptions(decode_set, decode_cfg);
  kvtransfer::registerOptions(kv_set, kv_cfg);

  auto loaded = loadCommandOptions(
      "usage: pdserve up [--model DIR] [--prefill N] [--decode M] [--tp T] [--mtp K] [--port P] [--smoke]\n"
      "                  [--device cpu|cuda[:N]] [--gpu_memory_utilization F] [--config FILE] [options]\n"
      "Starts a router, prefill workers and decode workers on this machine (on --model or the embedded default\n"
      "model), waits until they are ready and serves the OpenAI API on the router's port until Ctrl-C.\n"
      "Short flags: --model = --model.path, --prefill/--decode = --up.prefill/--up.decode,\n"
      "--tp = --decode.tensor_parallel, --mtp = --decode.num_speculative_tokens, --port = --router.port,\n"
      "--device = --model.device (cuda: every worker shares the GPU, each with an equal part of\n"
      "--model.gpu_memory_utilization).",
      {&common_sets.log, &common_sets.model, &common_sets.cluster, &common_sets.trace, &up_set, &router_set,
       &prefill_set, &decode_set, &kv_set},
      cluster::expandUpAliases(raw_args), &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, "up takes no positional arguments: " + loaded->positionals[0]));
  }
  if (auto valid = cluster::validateUpConfig(up_cfg, prefill_cfg.port, decode_cfg.port); !valid.ok()) {
    return reportFailure(valid.error());
  }
  // --device cuda: before anything is written or started, the device must be there (a machine
  // without a GPU fails here with "no CUDA device").
  auto device = gpu::parseModelDevice(common.model_device);
  if (!device.ok()) return reportFailure(device.error());
  if (Status s = checkGpuOptions(common); !s.ok()) return reportFailure(s.error());
  if (Status s = checkModelDevice(common); !s.ok()) return reportFailure(s.error());

  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  common.model_path = *model_dir;  // the children use the same folder, created once here
  auto exe = proc::selfExecutable();
  if (!exe.ok()) return reportFailure(exe.error());

  cluster::LocalClusterConfig cfg;
  cfg.up = up_cfg;
  cfg.executable = *exe;
  cfg.model_dir = *model_dir;
  cfg.cache_dir = common.cache_dir;
  cfg.cluster_secret_file = common.cluster_secret_file;
  cfg.served_model_name = router_cfg.served_model_name;
  cfg.child_settings = {&common_sets.log, &common_sets.model, &common_sets.cluster, &common_sets.trace,
                        &router_set,      &prefill_set,       &decode_set,          &kv_set};
  cfg.cuda = device->kind == gpu::ModelDevice::Kind::Cuda;
  cfg.gpu_memory_utilization = common.gpu_memory_utilization;
  auto exit_code = cluster::runLocalCluster(cfg);
  return exit_code.ok() ? *exit_code : reportFailure(exit_code.error());
}

}  // namespace pd::cli
