// pdserve logits | generate: the model engine run in one process (tools/model_tools/model_run.h).
#include <cstdio>
#include <string>
#include <vector>

#include "cli.h"
#include "model_tools/model_run.h"
#include "pd/common/kv_format.h"

namespace pd::cli {
namespace {

// Options every engine command shares (section of the command's own name).
struct EngineFlags {
  std::filesystem::path model;
  std::int64_t threads = 0;
  std::string isa = "auto";

  void add(config::OptionSet& set) {
    set.add("model", &model, "model folder; empty: model.path, or the embedded default model")
        .add("threads", &threads, "compute threads (0: every hardware thread)", 0, 1024)
        .add("isa", &isa, "kernel instruction set", {"auto", "avx512", "avx2", "generic"});
  }
};

// The engine the flags name: --model, else model.path, else the embedded default model.
Result<tools::EngineChoice> engineChoice(const EngineFlags& flags, const CommonConfig& common) {
  PD_TRY(checkGpuOptions(common));
  PD_TRY(checkModelDevice(common));
  PD_ASSIGN_OR_RETURN(const gpu::ModelDevice device, gpu::parseModelDevice(common.model_device));
  PD_ASSIGN_OR_RETURN(const gpu::Numerics numerics, gpu::parseNumerics(common.model_numerics));
  tools::EngineChoice choice{flags.model, flags.threads,     flags.isa, device, common.batch_invariant,
                             numerics,    common.cuda_graphs};
  if (choice.model.empty()) {
    PD_ASSIGN_OR_RETURN(choice.model, resolveModelDir(common));
  }
  return choice;
}

// Prints a command's answer, or reports its error.
int printAnswer(const Result<std::string>& answer) {
  if (!answer.ok()) return reportFailure(answer.error());
  std::fputs(answer->c_str(), stdout);
  return 0;
}

}  // namespace

int runLogits(const std::vector<std::string>& args) {
  CommonConfig common;
  CommonOptions common_sets(common);
  EngineFlags flags;
  std::string prompt_ids;
  std::filesystem::path out_path;
  config::OptionSet set("logits");
  flags.add(set);
  set.add("prompt_ids", &prompt_ids, "comma-separated prompt token ids, e.g. 1,2,3")
      .add("out", &out_path, "output .safetensors file");
  auto loaded = loadCommandOptions(
      "usage: pdserve logits --model DIR --prompt-ids 1,2,3 --out FILE.safetensors\n"
      "Runs the prompt through the model (float32, one prefill) and writes, all float32 and named as in the\n"
      "golden files: logits_all [N, vocab], kv_cache [layers, N, kv_lora_rank], pe_cache [layers, N, rope_dim],\n"
      "hidden_final [N, hidden] and mtp_logits_nozero [N, vocab] (the MTP layer over positions 0..N-1, position\n"
      "N-1 fed the greedy first token; only when the model has an MTP layer). Prints a JSON summary.",
      {&set, &common_sets.log, &common_sets.model}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (out_path.empty() || prompt_ids.empty()) {
    return reportFailure(makeError(ErrorCode::InvalidArgument, "logits needs --prompt-ids and --out (see --help)"));
  }
  auto engine = engineChoice(flags, common);
  if (!engine.ok()) return reportFailure(engine.error());
  return printAnswer(tools::writeLogits({*engine, prompt_ids, out_path}));
}

int runGenerate(const std::vector<std::string>& args) {
  CommonConfig common;
  CommonOptions common_sets(common);
  EngineFlags flags;
  std::string prompt_ids;
  std::int64_t max_tokens = 16;
  std::int64_t mtp = 0;
  std::int64_t seed = 0;
  std::int64_t top_k = 0;
  std::int64_t logprobs = 0;
  double temperature = 0.0, top_p = 1.0, min_p = 0.0, presence = 0.0, frequency = 0.0;
  bool ignore_eos = false;
  bool stats = false;
  std::string kv_dtype = "f32";
  config::OptionSet set("generate");
  flags.add(set);
  set.add("prompt_ids", &prompt_ids, "comma-separated prompt token ids, e.g. 1,2,3")
      .add("max_tokens", &max_tokens, "tokens to generate", 1, 1 << 20)
      .add("mtp", &mtp, "MTP draft tokens per decode step (0: no speculation)", 0, 8)
      .add("temperature", &temperature, "0: greedy", 0.0, 100.0)
      .add("top_k", &top_k, "0: no limit", 0, 1 << 30)
      .add("top_p", &top_p, "nucleus sampling mass", 1e-9, 1.0)
      .add("min_p", &min_p, "drop tokens below min_p x the top probability", 0.0, 1.0)
      .add("presence_penalty", &presence, "OpenAI presence penalty", -2.0, 2.0)
      .add("frequency_penalty", &frequency, "OpenAI frequency penalty", -2.0, 2.0)
      .add("seed", &seed, "sampling seed: the same seed gives the same tokens", 0, INT64_MAX)
      .add("logprobs", &logprobs, "also print the top-N logprobs of each token (0..20)", 0, 20)
      .add("ignore_eos", &ignore_eos, "keep generating after the end-of-sequence token")
      .add("kv_dtype", &kv_dtype, "element type of the latent KV cache (as decode.kv_dtype)", {"f32", "bf16", "fp8"})
      .add("stats", &stats, "also print timing and MTP acceptance");
  auto loaded = loadCommandOptions(
      "usage: pdserve generate --model DIR --prompt-ids 1,2,3 --max-tokens N [--temperature T --seed S] [--mtp K]\n"
      "Single-process generation (prefill, then decode; optional MTP speculation, which never changes the\n"
      "output). Prints {\"ids\": [...]}.",
      {&set, &common_sets.log, &common_sets.model}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (prompt_ids.empty()) return reportFailure(makeError(ErrorCode::InvalidArgument, "generate needs --prompt-ids"));
  auto engine = engineChoice(flags, common);
  if (!engine.ok()) return reportFailure(engine.error());
  tools::GenerateRequest request{*engine, prompt_ids, {}, stats};
  model::GenerateOptions& o = request.options;
  o.max_tokens = max_tokens;
  o.mtp_drafts = mtp;
  o.stop_at_eos = !ignore_eos;
  o.cache_dtype = parseKvDType(kv_dtype).value_or(DType::F32);
  o.sampling.temperature = temperature;
  o.sampling.top_k = top_k;
  o.sampling.top_p = top_p;
  o.sampling.min_p = min_p;
  o.sampling.presence_penalty = presence;
  o.sampling.frequency_penalty = frequency;
  o.sampling.seed = static_cast<std::uint64_t>(seed);
  o.sampling.top_logprobs = logprobs;
  return printAnswer(tools::generateJson(request));
}

}  // namespace pd::cli
