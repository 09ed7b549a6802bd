#pragma once
/// Token sampling from logits: greedy, temperature, top-k, top-p, min-p, presence/frequency
/// penalties, a per-request seeded RNG (same seed and logits -> same tokens on any machine), and
/// top-n logprobs.
///
/// Order of operations (as vLLM): penalties on the raw logits (from the tokens this sampler has
/// produced so far), then logit_bias, then the allowed-token mask (grammar-constrained decoding:
/// tokens outside it get -inf), then temperature; greedy when temperature == 0 (argmax, lowest id
/// on ties); otherwise top-k, then top-p over the remaining probability mass, then min-p relative
/// to the most likely token, then one uniform draw from the RNG. Logprobs are those of the raw
/// model distribution (log_softmax of the logits, before penalties, bias, mask and temperature).
///
/// Thread rules: a Sampler belongs to one request and is used by one thread at a time.

#include <cstdint>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pd/common/generation.h"
#include "pd/common/result.h"

namespace pd::model {

using pd::SampledToken;  // logprob of `token` under the raw model distribution; top descending
using pd::SamplingParams;
using pd::TokenLogprob;

class Sampler {
 public:
  /// The params must have passed validate() (PD_CHECKed). Without `logprobs`, sampled tokens
  /// carry logprob 0 and no alternatives: the log-softmax over the whole vocabulary (one more
  /// pass over it per token, most of a greedy sample's cost) is skipped.
  explicit Sampler(SamplingParams params, bool logprobs = true);

  /// Picks the next token from one row of logits and records it for the penalties. Consumes
  /// exactly one RNG draw when temperature > 0, none when greedy. `allowed`, when not empty, is a
  /// bitset over token ids (bit t of word t / 64; pd::structured::Matcher::fillMask writes one):
  /// only tokens whose bit is set can be sampled. PD_CHECKs that it covers the logits and allows at
  /// least one of them.
  SampledToken sample(std::span<const float> logits, std::span<const std::uint64_t> allowed = {});

  /// Records a token produced elsewhere (e.g. the first token sampled by a prefill worker) for
  /// the penalties, without sampling.
  void observe(std::int32_t token);

  /// Puts a fresh sampler where one that had produced `produced` would be: each is observed for
  /// the penalties and, when temperature > 0, consumes its one draw. The RNG's n-th draw depends
  /// only on the seed and n (splitmix64), so a generation resumed elsewhere after n tokens
  /// (docs/kv-memory.md, "Resume") samples what the uninterrupted one would have.
  void resumeAfter(std::span<const std::int32_t> produced);

  [[nodiscard]] const SamplingParams& params() const { return params_; }
  /// RNG draws consumed so far: the index of the next one (a device sampler's RowSample::draw).
  [[nodiscard]] std::uint64_t draws() const { return draws_; }
  /// The tokens recorded for the penalties, each with its count, ascending by id.
  [[nodiscard]] std::vector<std::pair<std::int32_t, std::int64_t>> counts() const;

 private:
  double nextUniform();  // [0, 1), 53 random bits
  /// Draws from work_ (the candidates' adjusted logits): the index of the chosen one.
  std::int32_t pick();

  SamplingParams params_;
  bool logprobs_;
  std::uint64_t rng_state_;
  std::uint64_t draws_ = 0;
  std::unordered_map<std::int32_t, std::int64_t> counts_;
  std::vector<float> work_;               // adjusted logits: of every token, or of candidates_
  std::vector<std::int32_t> candidates_;  // a sparse mask's allowed ids (ascending); empty: all tokens
  std::vector<std::int32_t> order_;
};

/// Index of the largest logit, lowest index on ties.
[[nodiscard]] std::int32_t argmax(std::span<const float> logits);

}  // namespace pd::model
