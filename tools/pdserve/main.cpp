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

/// `pdserve bench <what>`: engine, kv, decode, prefill, router, comm, serve.
int runBench(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "kv") return pd::cli::runBenchKv({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "engine") return pd::cli::runBenchEngine({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "prefill") return pd::cli::runBenchPrefill({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "router") return pd::cli::runBenchRouter({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "comm") return pd::cli::runBenchComm({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "decode") return pd::cli::runBenchDecode({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "serve") return pd::cli::runBenchServe({args.begin() + 1, args.end()});
  std::fprintf(stderr,
               "pdserve bench: unknown benchmark '%s'; one of: engine, kv, decode, prefill, router, comm, serve\n",
               args.empty() ? "" : args[0].c_str());
  return 2;
}

constexpr Command kCommands[] = {
    {"up", "start a whole local cluster (router + prefill + decode) on a model", pd::cli::runUp, ""},
    {"router", "run the OpenAI-compatible router", pd::cli::runRouter, ""},
    {"prefill", "run a prefill worker", pd::cli::runPrefill, ""},
    {"decode", "run a decode worker", pd::cli::runDecode, ""},
    {"inspect", "summarize a checkpoint: config, parameters, bytes, KV per token, tensor check", pd::cli::runInspect,
     ""},
    {"make-model", "write a random-weight DeepSeek-V3-layout checkpoint", pd::cli::runMakeModel, ""},
    {"tokenize", "JSONL {\"text\"} -> {\"ids\"} with the model's tokenizer", pd::cli::runTokenize, ""},
    {"detokenize", "JSONL {\"ids\"} -> {\"text\"}", pd::cli::runDetokenize, ""},
    {"chat-template", "JSONL {\"messages\"} -> {\"rendered\", \"ids\"} (the chat template)", pd::cli::runChatTemplate,
     ""},
    {"logits", "run a prompt through the model; write logits, latent KV, hidden states (safetensors)",
     pd::cli::runLogits, ""},
    {"generate", "greedy/sampled generation in one process (prefill + decode, optional MTP)", pd::cli::runGenerate, ""},
    {"bench",
     "benchmarks vs ceilings measured in the same run: engine, kv, decode, prefill, router, comm; serve (load)",
     runBench, ""},
    {"trace", "one request's timeline from a --trace.file (docs/observability.md)", pd::cli::runTrace, ""},
    {"plan", "capacity planner: decode tokens/s, TTFT, KV bytes, prefill:decode pools (docs/planner.md)",
     pd::cli::runPlan, ""},
};

void printUsage(std::FILE* out) {
  std::fprintf(out, "usage: pdserve <command> [options]   (pdserve <command> --help for its options)\n\ncommands:\n");
  for (const auto& c : kCommands) {
    std::fprintf(out, "  %-13s %.*s%s%.*s%s\n", std::string(c.name).c_str(), static_cast<int>(c.summary.size()),
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
      std::fprintf(stderr, "pdserve %s: not built yet (tracked in %.*s)\n", argv[1], static_cast<int>(c.issue.size()),
                   c.issue.data());
      return c.run(args);
    }
    return c.run(args);
  }
  std::fprintf(stderr, "pdserve: unknown command '%s'\n\n", argv[1]);
  printUsage(stderr);
  return 2;
}
