// pdserve plan: the analytical capacity model of tools/plan (docs/planner.md) from flags, as text
// or one JSON object; --calibrate BENCH.json fits its efficiency constants to measurements
// (tools/plan/plan_command.h).
// Thread rules: main thread only.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "cli.h"
#include "plan_command.h"

namespace pd::cli {

int runPlan(const std::vector<std::string>& args) {
  plan::PlanFlags flags;
  config::OptionSet set("plan");
  plan::registerPlanOptions(set, flags);
  auto loaded = loadCommandOptions(
      "usage: pdserve plan [--model PRESET|DIR] [--hardware NAME] [layout, workload, SLO flags] [--json]\n"
      "       pdserve plan --calibrate BENCH.json [--model ...] [--json]\n"
      "Predicts DeepSeek-V3-class serving with disaggregated prefill and decode pools: decode tokens/s per user and\n"
      "in total with the step time split into weight reads, KV reads, compute, collectives and MTP drafts; TTFT\n"
      "split into queueing, prefill compute and KV transfer; KV bytes per request; memory per GPU; and the\n"
      "prefill:decode pools meeting the SLOs at the fewest GPUs. The model and its constants: docs/planner.md.",
      {&set}, args);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument,
                  fmt::format("plan takes no positional arguments (got '{}'; see --help)", loaded->positionals[0])));
  }
  auto done = flags.calibrate.empty() ? plan::runPlan(flags) : plan::runCalibration(flags);
  return done.ok() ? 0 : reportFailure(done.error());
}

}  // namespace pd::cli
