// pdserve: one binary, one subcommand per role or tool.
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "cli.h"

namespace {

struct Command {
  std::string_view name;
  std::string_view summary;
  int (*run)(const std::vector<std::string>& args);
  std::string_view issue;  ///< set while the command is not built yet
};

int notYetBuilt(const std::vector<std::string>& /*args*/) { return 3; }

constexpr Command kCommands[] = {
    {"up", "start a whole local cluster (router + prefill + decode) on a model", pd::cli::runUp, ""},
    {"router", "run the OpenAI-compatible router", notYetBuilt, "issue 8"},
    {"prefill", "run a prefill worker", notYetBuilt, "issue 7"},
    {"decode", "run a decode worker", notYetBuilt, "issue 6"},
    {"inspect", "summarize a checkpoint: config, parameters, bytes, KV per token, tensor check",
     pd::cli::runInspect, ""},
    {"make-model", "write a random-weight DeepSeek-V3-layout checkpoint", pd::cli::runMakeModel, ""},
    {"tokenize", "tokenize JSONL text from stdin", notYetBuilt, "issue 3"},
    {"logits", "print logits of a prompt", notYetBuilt, "issue 4"},
    {"generate", "greedy/sampled generation in one process", notYetBuilt, "issue 4"},
    {"bench", "load generator against an OpenAI-compatible server", notYetBuilt, "issue 10"},
    {"plan", "capacity planner", notYetBuilt, "issue 10"},
};

void printUsage(std::FILE* out) {
  std::fprintf(out, "usage: pdserve <command> [options]   (pdserve <command> --help for its options)\n\ncommands:\n");
  for (const auto& c : kCommands) {
    std::fprintf(out, "  %-11s %.*s%s%.*s%s\n", std::string(c.name).c_str(), static_cast<int>(c.summary.size()),
                 c.summary.data(), c.issue.empty() ? "" : " [not built yet: ", static_cast<int>(c.issue.size()),
                 c.issue.data(), c.issue.empty() ? "" : "]");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    printUsage(stderr);
    return 2;
  }
  const std::string_view name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    printUsage(stdout);
    return 0;
  }
  const std::vector<std::string> args(argv + 2, argv + argc);
  for (const auto& c : kCommands) {
    if (c.name != name) continue;
    if (!c.issue.empty()) {
      std::fprintf(stderr, "pdserve %s: not built yet (tracked in %.*s)\n", argv[1],
                   static_cast<int>(c.issue.size()), c.issue.data());
      return c.run(args);
    }
    return c.run(args);
  }
  std::fprintf(stderr, "pdserve: unknown command '%s'\n\n", argv[1]);
  printUsage(stderr);
  return 2;
}
