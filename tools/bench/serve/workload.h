#pragma once
/// The requests `pdserve bench serve` sends: OpenAI-API request bodies built from random-token
/// prompts of set lengths (no dataset download) or from a JSONL file, and the send times of a
/// Poisson process for request-rate runs.
///
/// Random prompts: for /v1/completions, `input_tokens` token ids drawn uniformly from
/// [token_id_min, token_id_max) (pdserve and vLLM take token-id prompts as they are, so the input
/// length is exact); for /v1/chat/completions, `input_tokens` random lowercase words (about one
/// token each, the chat template adds its own). Every body asks for streaming with usage,
/// `ignore_eos` (so outputs run to max_tokens on servers that honour it) and, optionally,
/// `return_token_ids` (so multi-token chunks are counted per token).
///
/// Thread rules: plain values and pure functions (seeded, deterministic).

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "pd/common/result.h"

namespace pd::bench {

enum class Endpoint { Completions, Chat };

/// "/v1/completions" or "/v1/chat/completions".
const char* endpointPath(Endpoint endpoint);

/// One request to send.
struct RequestSpec {
  std::string body;                ///< the JSON body
  std::int64_t prompt_tokens = 0;  ///< the prompt length when known (random prompts), else 0
  std::int64_t max_tokens = 0;
};

struct WorkloadOptions {
  std::string model;
  Endpoint endpoint = Endpoint::Completions;
  std::int64_t input_tokens = 128;
  std::int64_t output_tokens = 128;
  std::int64_t token_id_min = 100;
  std::int64_t token_id_max = 30000;  ///< exclusive; keep inside every served vocabulary
  bool ignore_eos = true;
  bool return_token_ids = true;
  double temperature = 0;
  std::uint64_t seed = 0;
};

/// What GET /v1/models says about the first model it lists.
struct ServedModel {
  std::string id;
  std::int64_t max_model_len = 0;  ///< the context in tokens; 0 when not reported
  std::int64_t vocab_size = 0;     ///< token ids are below it; 0 when not reported
};
/// Parses a /v1/models body (OpenAI's {"data": [{"id": ...}, ...]}, with pdserve's and vLLM's
/// optional "max_model_len" and an optional "vocab_size"). PeerFailed when no model is listed.
Result<ServedModel> parseModelList(const std::string& body);

/// Fits random prompts to the model that serves them: token ids below `vocab_size` (> 0; the
/// range [token_id_min, token_id_max) is cut at it, and token_id_min lowered when it is not below
/// it), and, when `max_model_len` > 0, prompt plus output within the context (output_tokens first,
/// then input_tokens, are shortened to fit, each to at least 1). Returns a line for each change
/// made; InvalidArgument when even 1 + 1 tokens do not fit.
Result<std::vector<std::string>> fitWorkload(WorkloadOptions& options, std::int64_t vocab_size,
                                             std::int64_t max_model_len);

/// "1,2,4" or "0.5,2" -> the numbers; InvalidArgument naming --`flag` unless every item is a
/// finite number > 0.
Result<std::vector<double>> parsePositiveNumbers(const std::string& text, const std::string& flag);

/// `count` random-prompt requests; request i depends only on (seed, i).
std::vector<RequestSpec> randomRequests(const WorkloadOptions& options, std::int64_t count);

/// A parsed JSONL prompt file: one object per line, {"prompt": "..." | [ids]} or
/// {"messages": [...]}, optional "max_tokens" (else options.output_tokens). Blank lines are
/// skipped. A "prompt" string goes to chat as one user message; "messages" need the chat endpoint.
/// Errors: NotFound (cannot open), InvalidArgument (the line and what is wrong with it).
Result<std::vector<RequestSpec>> loadPromptFile(const std::filesystem::path& path, const WorkloadOptions& options);
/// Same, from the file's text (`name` is used in errors).
Result<std::vector<RequestSpec>> parsePromptLines(const std::string& text, const std::string& name,
                                                  const WorkloadOptions& options);

/// Send times (seconds from the start) of `count` requests of a Poisson process of `rate`
/// requests/s: exponential gaps, the first one included. `rate` must be > 0.
std::vector<double> poissonArrivals(double rate, std::int64_t count, std::uint64_t seed);

/// `count` token ids drawn uniformly from [min, max) by a generator seeded with `seed` (max > min).
std::vector<std::int64_t> randomTokenIds(std::uint64_t seed, std::int64_t count, std::int64_t min, std::int64_t max);

/// A uniform double in [0, 1) from a 64-bit word (the top 53 bits).
double unitInterval(std::uint64_t bits);

}  // namespace pd::bench
