#pragma once
/// The model engine run in one process, behind `pdserve logits` and `pdserve generate`:
///  - logits: every golden-comparable tensor of one prompt, written as safetensors;
///  - generate: prefill + decode (+ MTP speculation), the reference the disaggregated system is
///    tested against.
///
/// Thread rules: main thread only (the engine's own pool does the compute); parsePromptIds and
/// idsJson are pure.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/generate.h"
#include "pd/engine/gpu.h"

namespace pd::tools {

/// Which engine to open.
struct EngineChoice {
  std::filesystem::path model;   ///< resolved model folder
  std::int64_t threads = 0;      ///< 0: every hardware thread
  std::string isa = "auto";      ///< auto, avx512, avx2 or generic (CPU engine)
  gpu::ModelDevice device;       ///< cpu: the CPU engine; cuda:N: the CUDA engine on device N
  bool batch_invariant = false;  ///< CPU engine: CpuEngineOptions::batch_invariant (model.batch_invariant)
  gpu::Numerics numerics = gpu::Numerics::Fp32;  ///< CUDA engine: CudaEngineOptions::numerics (model.numerics)
  bool cuda_graphs = true;                       ///< CUDA engine: CudaEngineOptions::cuda_graphs (model.cuda_graphs)
};

/// "1, 2,3" -> {1, 2, 3}: comma-separated ids in [0, vocab), blanks around each allowed;
/// InvalidArgument naming --prompt-ids and the bad item otherwise.
[[nodiscard]] Result<std::vector<std::int32_t>> parsePromptIds(const std::string& text, std::int64_t vocab);

/// {1, 2} -> "[1, 2]".
[[nodiscard]] std::string idsJson(const std::vector<std::int32_t>& ids);

struct LogitsRequest {
  EngineChoice engine;
  std::string prompt_ids;  ///< as parsePromptIds reads them
  std::filesystem::path out;
};

/// Runs the prompt through the model (float32, one prefill) and writes, all float32 and named as
/// in the golden files: logits_all [N, vocab], kv_cache [layers, N, kv_lora_rank], pe_cache
/// [layers, N, rope_dim], hidden_final [N, hidden] and, when the model has an MTP layer,
/// mtp_logits_nozero [N, vocab]. Returns the one-line JSON summary (out, tokens, argmax,
/// first_token, mtp).
[[nodiscard]] Result<std::string> writeLogits(const LogitsRequest& request);

struct GenerateRequest {
  EngineChoice engine;
  std::string prompt_ids;
  model::GenerateOptions options;
  bool stats = false;  ///< add timing and MTP acceptance to the answer
};

/// Single-process generation; the one-line JSON answer {"ids": [...]} with, when asked, each
/// token's logprobs (options.sampling.top_logprobs > 0) and the stats.
[[nodiscard]] Result<std::string> generateJson(const GenerateRequest& request);

}  // namespace pd::tools
