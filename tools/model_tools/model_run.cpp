// The model engine in one process (model_run.h): logits of one prompt as safetensors, and
// single-process generation.
#include "model_tools/model_run.h"

#include <fmt/format.h>
#include <fmt/printf.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "pd/engine/cuda_engine.h"
#include "pd/engine/engine.h"
#include "pd/engine/kernels.h"
#include "pd/engine/safetensors.h"
#include "pd/engine/sampling.h"

namespace pd::tools {
namespace {

using model::Engine;

Result<std::unique_ptr<Engine>> openEngine(const EngineChoice& choice) {
  if (choice.device.kind == gpu::ModelDevice::Kind::Cuda) {
    model::CudaEngineOptions cuda;
    cuda.device = choice.device;
    cuda.numerics = choice.numerics;
    cuda.cuda_graphs = choice.cuda_graphs;
    cuda.batch_invariant = choice.batch_invariant;
    return model::createCudaEngine(choice.model, cuda);
  }
  PD_TRY(gpu::checkNumericsOnDevice(choice.device, choice.numerics));
  model::CpuEngineOptions options;
  options.threads = static_cast<int>(choice.threads);
  options.batch_invariant = choice.batch_invariant;
  if (choice.isa == "avx512") options.isa = model::CpuIsa::Avx512;
  if (choice.isa == "avx2") options.isa = model::CpuIsa::Avx2;
  if (choice.isa == "generic") options.isa = model::CpuIsa::Generic;
  return model::createCpuEngine(choice.model, options);
}

TensorToWrite f32Tensor(std::string name, std::vector<std::int64_t> shape, const std::vector<float>& data) {
  return {std::move(name), DType::F32, std::move(shape),
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(data.data()), data.size() * sizeof(float))};
}

}  // namespace

Result<std::vector<std::int32_t>> parsePromptIds(const std::string& text, std::int64_t vocab) {
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

std::string idsJson(const std::vector<std::int32_t>& ids) {
  std::string out = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}

Result<std::string> writeLogits(const LogitsRequest& request) {
  auto engine = openEngine(request.engine);
  if (!engine.ok()) return engine.error();
  Engine& e = **engine;
  const ModelConfig& cfg = e.config();
  auto ids = parsePromptIds(request.prompt_ids, cfg.vocab_size);
  if (!ids.ok()) return ids.error();
  const auto n = static_cast<std::int64_t>(ids->size());

  constexpr std::int64_t kBlock = 64;
  auto cache = model::PagedLatentCache::create(cfg, (n + kBlock - 1) / kBlock, kBlock);
  if (!cache.ok()) return cache.error();
  std::vector<std::int32_t> table(static_cast<std::size_t>((n + kBlock - 1) / kBlock));
  std::iota(table.begin(), table.end(), 0);
  const model::SequenceChunk chunk{*ids, 0, table};
  model::ForwardOptions fo;
  fo.logits = model::OutputRows::All;
  fo.hidden = model::OutputRows::All;
  auto out = e.forward(std::span<const model::SequenceChunk>(&chunk, 1), cache->view(), fo);
  if (!out.ok()) return out.error();

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
  argmaxes.reserve(static_cast<std::size_t>(n));
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
    if (!mtp.ok()) return mtp.error();
    mtp_logits = std::move(mtp->logits);
    tensors.push_back(f32Tensor("mtp_logits_nozero", {n, cfg.vocab_size}, mtp_logits));
  }
  if (auto st = writeSafetensors(request.out, tensors); !st.ok()) return st.error();
  return fmt::sprintf("{\"out\": \"%s\", \"tokens\": %lld, \"argmax\": %s, \"first_token\": %d, \"mtp\": %s}\n",
                      request.out.string(), static_cast<long long>(n), idsJson(argmaxes), argmaxes.back(),
                      mtp_logits.empty() ? "false" : "true");
}

Result<std::string> generateJson(const GenerateRequest& request) {
  auto engine = openEngine(request.engine);
  if (!engine.ok()) return engine.error();
  auto ids = parsePromptIds(request.prompt_ids, (*engine)->config().vocab_size);
  if (!ids.ok()) return ids.error();
  const auto start = std::chrono::steady_clock::now();
  // On a CUDA device the tokens are sampled there (only ids and logprobs cross to the host).
  model::GenerateOptions options = request.options;
  options.device_sampling = request.engine.device.kind == gpu::ModelDevice::Kind::Cuda;
  auto res = model::generate(**engine, *ids, options);
  if (!res.ok()) return res.error();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string line = "{\"ids\": " + idsJson(res->tokens);
  if (request.options.sampling.top_logprobs > 0) {
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
  if (request.stats) {
    line += fmt::format(", \"seconds\": {:.4f}, \"decode_steps\": {}, \"drafts_proposed\": {}, \"drafts_accepted\": {}",
                        seconds, res->decode_steps, res->drafts_proposed, res->drafts_accepted);
  }
  return line + "}\n";
}

}  // namespace pd::tools
