// pdserve up: a whole local cluster (router + prefill + decode) on one machine.
#include <cstdio>

#include "cli.h"
#include "pd/common/log.h"
#include "pd/common/model_config.h"
#include "pd/common/safetensors.h"
#include "pd/decode/decode_config.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/prefill/prefill_config.h"
#include "pd/router/router_config.h"

namespace pd::cli {

int runUp(const std::vector<std::string>& args) {
  CommonConfig common;
  router::RouterConfig router_cfg;
  prefill::PrefillConfig prefill_cfg;
  decode::DecodeConfig decode_cfg;
  kvtransfer::KvTransferConfig kv_cfg;
  CommonOptions common_sets(common);
  config::OptionSet router_set("router");
  config::OptionSet prefill_set("prefill");
  config::OptionSet decode_set("decode");
  config::OptionSet kv_set("kvtransfer");
  router::registerOptions(router_set, router_cfg);
  prefill::registerOptions(prefill_set, prefill_cfg);
  decode::registerOptions(decode_set, decode_cfg);
  kvtransfer::registerOptions(kv_set, kv_cfg);

  auto loaded = loadCommandOptions(
      "usage: pdserve up [--config FILE] [options]\n"
      "Starts a router, a prefill worker and a decode worker on this machine, on --model.path or the\n"
      "embedded default model.",
      {&common_sets.log, &common_sets.model, &router_set, &prefill_set, &decode_set, &kv_set}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, "up takes no positional arguments: " + loaded->positionals[0]));
  }
  for (auto* set : {&common_sets.log, &common_sets.model, &router_set, &prefill_set, &decode_set, &kv_set}) {
    for (const auto& line : set->describeValues()) log::debug("up", "{}", line);
  }

  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  auto model_config = ModelConfig::load(*model_dir);
  if (!model_config.ok()) return reportFailure(model_config.error());
  auto checkpoint = Checkpoint::open(*model_dir);
  if (!checkpoint.ok()) return reportFailure(checkpoint.error());
  if (auto valid = validateCheckpoint(*model_config, *checkpoint); !valid.ok()) return reportFailure(valid.error());

  log::info("up", "model {}: {} layers (+{} MTP), hidden {}, vocab {}, {} tensors, {:.1f} MB", model_dir->string(),
            model_config->num_hidden_layers, model_config->num_nextn_predict_layers, model_config->hidden_size,
            model_config->vocab_size, checkpoint->tensors().size(),
            static_cast<double>(checkpoint->totalTensorBytes()) / 1e6);
  std::printf(
      "pdserve up: model loaded from %s; not yet serving: the router (issue 8), prefill (issue 7) and "
      "decode (issue 6) workers are not built yet\n",
      model_dir->string().c_str());
  return 0;
}

}  // namespace pd::cli
