// pdserve logits | generate | bench engine: the model engine run in one process.
//  - logits: every golden-comparable tensor of one prompt, written as safetensors;
//  - generate: prefill + decode (+ MTP speculation), the reference the disaggregated system
//    is tested against;
//  - bench engine: decode memory-bandwidth utilization and prefill FLOP utilization, as ratios
//    to ceilings measured in the same run with the same threads.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "pd/engine/engine.h"
#include "pd/engine/generate.h"
#include "pd/engine/kernels.h"
#include "pd/engine/safetensors.h"
#include "pd/engine/sampling.h"
#include "pd/engine/thread_pool.h"

namespace pd::cli {
namespace {

using model::Engine;

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

Result<std::unique_ptr<Engine>> openEngine(const EngineFlags& flags, const CommonConfig& common) {
  std::filesystem::path dir = flags.model;
  if (dir.empty()) {
    PD_ASSIGN_OR_RETURN(dir, resolveModelDir(common));
  }
  model::CpuEngineOptions options;
  options.threads = static_cast<int>(flags.threads);
  if (flags.isa == "avx512") options.isa = model::CpuIsa::Avx512;
  if (flags.isa == "avx2") options.isa = model::CpuIsa::Avx2;
  if (flags.isa == "generic") options.isa = model::CpuIsa::Generic;
  return model::createCpuEngine(dir, options);
}

Result<std::vector<std::int32_t>> parseIds(const std::string& text, std::int64_t vocab) {
  std::vector<std::int32_t> ids;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(pos, end - pos);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    std::int64_t v = -1;
    const auto res = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || res.ec != std::errc() || res.ptr != item.data() + item.size() || v < 0 || v >= vocab) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("--prompt-ids: '{}' is not a token id in [0, {})", item, vocab));
    }
    ids.push_back(static_cast<std::int32_t>(v));
    pos = end + 1;
  }
  return ids;
}

std::string jsonIds(const std::vector<std::int32_t>& ids) {
  std::string out = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}

TensorToWrite f32Tensor(std::string name, std::vector<std::int64_t> shape, const std::vector<float>& data) {
  return {std::move(name), DType::F32, std::move(shape),
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(data.data()), data.size() * sizeof(float))};
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
  auto engine = openEngine(flags, common);
  if (!engine.ok()) return reportFailure(engine.error());
  Engine& e = **engine;
  const ModelConfig& cfg = e.config();
  auto ids = parseIds(prompt_ids, cfg.vocab_size);
  if (!ids.ok()) return reportFailure(ids.error());
  const auto n = static_cast<std::int64_t>(ids->size());

  constexpr std::int64_t kBlock = 64;
  auto cache = model::PagedLatentCache::create(cfg, (n + kBlock - 1) / kBlock, kBlock);
  if (!cache.ok()) return reportFailure(cache.error());
  std::vector<std::int32_t> table(static_cast<std::size_t>((n + kBlock - 1) / kBlock));
  std::iota(table.begin(), table.end(), 0);
  const model::SequenceChunk chunk{*ids, 0, table};
  model::ForwardOptions fo;
  fo.logits = model::OutputRows::All;
  fo.hidden = model::OutputRows::All;
  auto out = e.forward(std::span<const model::SequenceChunk>(&chunk, 1), cache->view(), fo);
  if (!out.ok()) return reportFailure(out.error());

  const std::int64_t layers = cfg.num_hidden_layers;
  const std::int64_t r = cfg.kv_lora_rank;
  const std::int64_t ld = cfg.latentDim();
  std::vector<float> kv, pe, row(static_cast<std::size_t>(ld));
  for (std::int64_t l = 0; l < layers; ++l) {
    for (std::int64_t p = 0; p < n; ++p) {
      model::readLatent(cache->view(), l, table, p, row.data());
      kv.insert(kv.end(), row.begin(), row.begin() + r);
      pe.insert(pe.end(), row.begin() + r, row.end());
    }
  }
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  std::vector<std::int32_t> argmaxes;
  for (std::int64_t p = 0; p < n; ++p) {
    argmaxes.push_back(
        model::argmax(std::span<const float>(out->logits.data() + static_cast<std::size_t>(p) * vocab, vocab)));
  }
  std::vector<TensorToWrite> tensors{
      f32Tensor("logits_all", {n, cfg.vocab_size}, out->logits),
      f32Tensor("kv_cache", {layers, n, r}, kv),
      f32Tensor("pe_cache", {layers, n, cfg.qk_rope_head_dim}, pe),
      f32Tensor("hidden_final", {n, cfg.hidden_size}, out->hidden),
  };
  std::vector<float> mtp_logits;
  if (e.capabilities().mtp) {
    // Position i pairs token t[i+1] with h[i]; the last position gets the greedy first token.
    std::vector<std::int32_t> shifted(ids->begin() + 1, ids->end());
    shifted.push_back(argmaxes.back());
    const model::SequenceChunk m{shifted, 0, table, out->hidden};
    model::ForwardOptions mo;
    mo.logits = model::OutputRows::All;
    auto mtp = e.forwardMtp(std::span<const model::SequenceChunk>(&m, 1), cache->view(), mo);
    if (!mtp.ok()) return reportFailure(mtp.error());
    mtp_logits = std::move(mtp->logits);
    tensors.push_back(f32Tensor("mtp_logits_nozero", {n, cfg.vocab_size}, mtp_logits));
  }
  if (auto st = writeSafetensors(out_path, tensors); !st.ok()) return reportFailure(st.error());
  std::printf("{\"out\": \"%s\", \"tokens\": %lld, \"argmax\": %s, \"first_token\": %d, \"mtp\": %s}\n",
              out_path.string().c_str(), static_cast<long long>(n), jsonIds(argmaxes).c_str(), argmaxes.back(),
              mtp_logits.empty() ? "false" : "true");
  return 0;
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
      .add("stats", &stats, "also print timing and MTP acceptance");
  auto loaded = loadCommandOptions(
      "usage: pdserve generate --model DIR --prompt-ids 1,2,3 --max-tokens N [--temperature T --seed S] [--mtp K]\n"
      "Single-process generation (prefill, then decode; optional MTP speculation, which never changes the\n"
      "output). Prints {\"ids\": [...]}.",
      {&set, &common_sets.log, &common_sets.model}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (prompt_ids.empty()) return reportFailure(makeError(ErrorCode::InvalidArgument, "generate needs --prompt-ids"));
  auto engine = openEngine(flags, common);
  if (!engine.ok()) return reportFailure(engine.error());
  auto ids = parseIds(prompt_ids, (*engine)->config().vocab_size);
  if (!ids.ok()) return reportFailure(ids.error());
  model::GenerateOptions o;
  o.max_tokens = max_tokens;
  o.mtp_drafts = mtp;
  o.stop_at_eos = !ignore_eos;
  o.sampling.temperature = temperature;
  o.sampling.top_k = top_k;
  o.sampling.top_p = top_p;
  o.sampling.min_p = min_p;
  o.sampling.presence_penalty = presence;
  o.sampling.frequency_penalty = frequency;
  o.sampling.seed = static_cast<std::uint64_t>(seed);
  o.sampling.top_logprobs = logprobs;
  const auto start = std::chrono::steady_clock::now();
  auto res = model::generate(**engine, *ids, o);
  if (!res.ok()) return reportFailure(res.error());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string line = "{\"ids\": " + jsonIds(res->tokens);
  if (logprobs > 0) {
    line += ", \"logprobs\": [";
    for (std::size_t i = 0; i < res->samples.size(); ++i) {
      const auto& s = res->samples[i];
      line += fmt::format("{}{{\"id\": {}, \"logprob\": {:.6g}, \"top\": [", i ? ", " : "", s.token, s.logprob);
      for (std::size_t j = 0; j < s.top.size(); ++j) {
        line += fmt::format("{}[{}, {:.6g}]", j ? ", " : "", s.top[j].token, s.top[j].logprob);
      }
      line += "]}";
    }
    line += "]";
  }
  if (stats) {
    line += fmt::format(", \"seconds\": {:.4f}, \"decode_steps\": {}, \"drafts_proposed\": {}, \"drafts_accepted\": {}",
                        seconds, res->decode_steps, res->drafts_proposed, res->drafts_accepted);
  }
  std::printf("%s}\n", line.c_str());
  return 0;
}

}  // namespace pd::cli
