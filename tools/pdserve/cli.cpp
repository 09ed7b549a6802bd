#include "cli.h"

#include <fmt/format.h>
#include <signal.h>

#include <cstdio>
#include <ctime>

#include "cluster/local_cluster.h"
#include "pd/common/log.h"
#include "pd/common/log_format.h"
#include "pd/common/role_process.h"
#include "pd/decode/decode_config.h"
#include "pd/engine/gpu.h"
#include "pd/engine/model_factory.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/prefill/prefill_config.h"
#include "pd/router/router_config.h"

namespace pd::cli {
namespace {

// Every section the shared YAML file may hold, bound to scratch values: a command validates the
// whole file against these, so a typo in another role's section is still caught.
struct AllSections {
  CommonConfig common;
  router::RouterConfig router_cfg;
  prefill::PrefillConfig prefill_cfg;
  decode::DecodeConfig decode_cfg;
  kvtransfer::KvTransferConfig kv_cfg;
  cluster::UpConfig up_cfg;
  CommonOptions common_sets{common};
  config::OptionSet up{"up"};
  config::OptionSet router{"router"};
  config::OptionSet prefill{"prefill"};
  config::OptionSet decode{"decode"};
  config::OptionSet kvtransfer{"kvtransfer"};

  AllSections() {
    router::registerOptions(router, router_cfg);
    prefill::registerOptions(prefill, prefill_cfg);
    decode::registerOptions(decode, decode_cfg);
    kvtransfer::registerOptions(kvtransfer, kv_cfg);
    cluster::registerUpOptions(up, up_cfg);
  }
  std::vector<config::OptionSet*> sets() {
    return {&common_sets.log, &common_sets.model, &common_sets.cluster, &common_sets.trace, &up, &router, &prefill,
            &decode,          &kvtransfer};
  }
};

}  // namespace

CommonOptions::CommonOptions(CommonConfig& cfg) {
  log.add("level", &cfg.log_level, "log verbosity", {"debug", "info", "warn", "error", "off"})
      .add("format", &cfg.log_format, "log line format: text, or json (one JSON object per line)", {"text", "json"});
  model
      .add("path", &cfg.model_path, "model folder (Hugging Face DeepSeek-V3 layout); empty: the embedded default model")
      .add("tokenizer", &cfg.tokenizer_path, "tokenizer folder; empty: the model folder")
      .add("device", &cfg.model_device, "where the model runs: cpu, cuda or cuda:N (docs/gpu.md)")
      .add("batch_invariant", &cfg.batch_invariant,
           "batch-invariant numerics: a request's tokens are the same whatever it is batched, chunked or resumed with "
           "(slower; CPU engine; docs/engine.md)")
      .add("numerics", &cfg.model_numerics,
           "with model.device cuda: fp32 (FP32 activations and accumulation, the golden-parity mode) or bf16 (BF16 "
           "linears multiplied as stored with BF16-rounded inputs, FP32 accumulation; docs/gpu.md)",
           {"fp32", "bf16"})
      .add("cuda_graphs", &cfg.cuda_graphs,
           "with model.device cuda: replay decode steps as CUDA graphs captured per shape (false: every step eager; "
           "docs/gpu.md)")
      .add("gpu_memory_utilization", &cfg.gpu_memory_utilization,
           "with model.device cuda: fraction of the GPU's total memory this process may use, in (0, 1]; the KV "
           "pool takes what is left after weights, workspace and CUDA graphs (docs/gpu.md)",
           0.0, 1.0)
      .add("kv_cache_dtype", &cfg.kv_cache_dtype,
           "with model.device cuda: the device KV cache's element type (fp8: e4m3 with per-block scales)",
           {"bf16", "fp8"})
      .add("cache_dir", &cfg.cache_dir, "folder the embedded default model is written to on first use");
  cluster.add("secret_file", &cfg.cluster_secret_file,
              "file holding the cluster secret that signs internal calls (docs/security.md); empty: unauthenticated");
  trace::registerOptions(trace, cfg.trace);
}

bool takeCheckConfigFlag(std::vector<std::string>& args) {
  const auto is_flag = [](const std::string& a) { return a == "--check-config" || a == "--check_config"; };
  const auto before = args.size();
  std::erase_if(args, is_flag);
  return args.size() != before;
}

void printReadyLine(const std::string& fields) {
  std::printf("%.*s%s\n", static_cast<int>(proc::kReadyPrefix.size()), proc::kReadyPrefix.data(), fields.c_str());
  std::fflush(stdout);
}

int reportFailure(const Error& error) {
  std::fprintf(stderr, "pdserve: error: %s\n", error.toString().c_str());
  return error.code == ErrorCode::InvalidArgument ? 2 : 1;
}

Result<config::LoadOutput> loadCommandOptions(const std::string& usage, const std::vector<config::OptionSet*>& active,
                                              const std::vector<std::string>& args, const CommonConfig* common) {
  config::LoadInput input;
  input.args = args;
  AllSections scratch;
  std::vector<config::OptionSet*> all = active;
  for (auto* set : scratch.sets()) {
    bool shadowed = false;
    for (const auto* a : active) shadowed = shadowed || a->section() == set->section();
    if (!shadowed) all.push_back(set);
  }
  PD_ASSIGN_OR_RETURN(config::LoadOutput out, config::loadConfig(all, active, std::move(input)));
  if (out.help_requested) {
    std::printf("%s\n\noptions (YAML section / PDSERVE_<SECTION>_<NAME> / --name or --section.name):\n", usage.c_str());
    for (const auto* set : active) std::printf("%s", set->helpText().c_str());
    return out;
  }
  if (common != nullptr) {
    log::Level level = log::Level::Info;
    PD_CHECK(log::parseLevel(common->log_level, &level));  // choices were validated
    log::setLevel(level);
    log::Format format = log::Format::Text;
    PD_CHECK(log::parseFormat(common->log_format, &format));
    log::setFormat(format);
  }
  return out;
}

Status checkModelDevice(const CommonConfig& cfg) {
  PD_ASSIGN_OR_RETURN(const gpu::ModelDevice device, gpu::parseModelDevice(cfg.model_device));
  return gpu::checkModelDevice(device);
}

Status checkGpuOptions(const CommonConfig& cfg) {
  if (cfg.gpu_memory_utilization <= 0.0 || cfg.gpu_memory_utilization > 1.0) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("model.gpu_memory_utilization {} is not in (0, 1]", cfg.gpu_memory_utilization));
  }
  PD_ASSIGN_OR_RETURN(const gpu::Numerics numerics, gpu::parseNumerics(cfg.model_numerics));
  PD_ASSIGN_OR_RETURN(const gpu::ModelDevice device, gpu::parseModelDevice(cfg.model_device));
  return gpu::checkNumericsOnDevice(device, numerics);
}

Result<std::filesystem::path> resolveModelDir(const CommonConfig& cfg) {
  if (!cfg.model_path.empty()) return cfg.model_path;
  return ensureDefaultModel(cfg.cache_dir);
}

}  // namespace pd::cli
