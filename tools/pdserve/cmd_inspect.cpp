// pdserve inspect MODEL_DIR [--json]: what a checkpoint holds and what serving it costs
// (tools/model_tools/checkpoint_summary.h).
#include <cstdio>
#include <string>
#include <vector>

#include "cli.h"
#include "model_tools/checkpoint_summary.h"

namespace pd::cli {

int runInspect(const std::vector<std::string>& args) {
  bool as_json = false;
  config::OptionSet set("inspect");
  set.add("json", &as_json, "print one JSON object instead of text");
  auto loaded = loadCommandOptions(
      "usage: pdserve inspect MODEL_DIR [--json]\n"
      "Summarizes a Hugging Face DeepSeek-V3 checkpoint folder: config, parameter counts (main model and MTP),\n"
      "bytes by dtype, activated bytes per decoded token, latent KV bytes per token, and every tensor that is\n"
      "missing, unexpected or mis-shaped for its config.json. Exit status 0 when the checkpoint is valid.",
      {&set}, args);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (loaded->positionals.size() != 1) {
    return reportFailure(makeError(ErrorCode::InvalidArgument, "inspect takes exactly one MODEL_DIR (see --help)"));
  }
  const std::filesystem::path dir = loaded->positionals[0];

  auto inspection = tools::inspectCheckpoint(dir);
  if (!inspection.ok()) return reportFailure(inspection.error());
  const std::string report = as_json ? tools::inspectionJson(*inspection) : tools::inspectionText(*inspection);
  std::fputs(report.c_str(), stdout);
  std::fflush(stdout);
  return inspection->valid.ok() ? 0 : reportFailure(inspection->valid.error());
}

}  // namespace pd::cli
