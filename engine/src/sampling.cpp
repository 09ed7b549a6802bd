#include "pd/engine/sampling.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "pd/common/check.h"

namespace pd::model {

std::int32_t argmax(std::span<const float> logits) {
  PD_CHECK(!logits.empty());
  std::size_t best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<std::int32_t>(best);
}

Sampler::Sampler(SamplingParams params, bool logprobs)
    : params_(std::move(params)), logprobs_(logprobs), rng_state_(params_.seed) {
  PD_CHECK_MSG(validate(params_).ok(), "Sampler: invalid SamplingParams");
}

double Sampler::nextUniform() {
  // splitmix64: a fixed, portable sequence for a given seed.
  rng_state_ += 0x9E3779B97F4A7C15ULL;
  ++draws_;
  std::uint64_t z = rng_state_;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

void Sampler::observe(std::int32_t token) {
  ++counts_[token];
}

std::vector<std::pair<std::int32_t, std::int64_t>> Sampler::counts() const {
  std::vector<std::pair<std::int32_t, std::int64_t>> out(counts_.begin(), counts_.end());
  std::sort(out.begin(), out.end());
  return out;
}

void Sampler::resumeAfter(std::span<const std::int32_t> produced) {
  for (const std::int32_t token : produced) {
    observe(token);
    if (params_.temperature != 0.0) (void)nextUniform();
  }
}

std::int32_t Sampler::pick() {
  const auto n = static_cast<std::int64_t>(work_.size());
  if (params_.temperature == 0.0) return argmax(work_);
  const double inv_t = 1.0 / params_.temperature;
  const bool filtered = params_.top_k > 0 || params_.top_p < 1.0 || params_.min_p > 0.0;
  const float mx = work_[static_cast<std::size_t>(argmax(work_))];
  if (!filtered) {
    // Full distribution, scanned in token order.
    double total = 0.0;
    for (const float v : work_) total += std::exp((static_cast<double>(v) - mx) * inv_t);
    const double target = nextUniform() * total;
    double acc = 0.0;
    std::int32_t last_possible = 0;  // where rounding leaves acc <= target: the last token with weight
    for (std::int64_t i = 0; i < n; ++i) {
      const double w = std::exp((static_cast<double>(work_[static_cast<std::size_t>(i)]) - mx) * inv_t);
      if (w > 0.0) last_possible = static_cast<std::int32_t>(i);
      acc += w;
      if (acc > target) return static_cast<std::int32_t>(i);
    }
    return last_possible;
  }
  order_.resize(static_cast<std::size_t>(n));
  std::iota(order_.begin(), order_.end(), 0);
  const auto by_logit = [&](std::int32_t a, std::int32_t b) {
    const float va = work_[static_cast<std::size_t>(a)];
    const float vb = work_[static_cast<std::size_t>(b)];
    return va > vb || (va == vb && a < b);
  };
  std::int64_t keep = n;
  if (params_.top_k > 0 && params_.top_k < n) {
    keep = params_.top_k;
    std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), by_logit);
  } else {
    std::sort(order_.begin(), order_.end(), by_logit);
  }
  std::vector<double> prob(static_cast<std::size_t>(keep));
  double total = 0.0;
  for (std::int64_t i = 0; i < keep; ++i) {
    prob[static_cast<std::size_t>(i)] = std::exp(
        (static_cast<double>(work_[static_cast<std::size_t>(order_[static_cast<std::size_t>(i)])]) - mx) * inv_t);
    total += prob[static_cast<std::size_t>(i)];
  }
  if (params_.top_p < 1.0) {
    double acc = 0.0;
    std::int64_t i = 0;
    for (; i < keep; ++i) {
      acc += prob[static_cast<std::size_t>(i)];
      if (acc >= params_.top_p * total) break;
    }
    keep = std::min(keep, i + 1);
  }
  if (params_.min_p > 0.0) {
    const double floor = params_.min_p * prob[0];
    std::int64_t i = 1;
    while (i < keep && prob[static_cast<std::size_t>(i)] >= floor) ++i;
    keep = i;
  }
  total = 0.0;
  for (std::int64_t i = 0; i < keep; ++i) total += prob[static_cast<std::size_t>(i)];
  const double target = nextUniform() * total;
  double acc = 0.0;
  while (keep > 1 && prob[static_cast<std::size_t>(keep - 1)] == 0.0) --keep;  // masked tokens have no weight
  for (std::int64_t i = 0; i < keep; ++i) {
    acc += prob[static_cast<std::size_t>(i)];
    if (acc > target) return order_[static_cast<std::size_t>(i)];
  }
  return order_[static_cast<std::size_t>(keep - 1)];
}

// A mask that allows at most one token in this many is applied by gathering the allowed tokens
// (a grammar outside strings: punctuation, digits, an enum's next bytes) instead of copying and
// masking the whole vocabulary; both give the same token (docs/structured-outputs.md).
constexpr std::size_t kSparseMaskRatio = 16;

SampledToken Sampler::sample(std::span<const float> logits, std::span<const std::uint64_t> allowed) {
  PD_CHECK(!logits.empty());
  const auto vocab = static_cast<std::int64_t>(logits.size());
  if (!allowed.empty()) {
    PD_CHECK_MSG(allowed.size() * 64 >= logits.size(), "Sampler: the allowed-token mask is shorter than the logits");
  }
  std::size_t allowed_count = logits.size();
  if (!allowed.empty()) {
    allowed_count = 0;
    for (std::size_t w = 0; w * 64 < logits.size(); ++w) allowed_count += std::popcount(allowed[w]);
  }
  candidates_.clear();
  if (!allowed.empty() && allowed_count * kSparseMaskRatio <= logits.size()) {
    // Sparse: the candidates are the allowed ids in increasing order, their values gathered.
    work_.clear();
    for (std::size_t w = 0; w * 64 < logits.size(); ++w) {
      for (std::uint64_t bits = allowed[w]; bits != 0; bits &= bits - 1) {
        const std::size_t id = w * 64 + static_cast<std::size_t>(std::countr_zero(bits));
        if (id >= logits.size()) break;
        candidates_.push_back(static_cast<std::int32_t>(id));
        work_.push_back(logits[id]);
      }
    }
    PD_CHECK_MSG(!candidates_.empty(), "Sampler: the allowed-token mask allows no token");
    const auto slot = [&](std::int32_t token) -> float* {
      const auto it = std::lower_bound(candidates_.begin(), candidates_.end(), token);
      if (it == candidates_.end() || *it != token) return nullptr;
      return &work_[static_cast<std::size_t>(it - candidates_.begin())];
    };
    if (params_.presence_penalty != 0.0 || params_.frequency_penalty != 0.0) {
      for (const auto& [token, count] : counts_) {
        if (float* v = slot(token)) {
          *v -= static_cast<float>(params_.presence_penalty + params_.frequency_penalty * static_cast<double>(count));
        }
      }
    }
    for (const auto& b : params_.logit_bias) {
      if (float* v = slot(b.token)) *v += b.bias;
    }
  } else {
    work_.assign(logits.begin(), logits.end());
    if (params_.presence_penalty != 0.0 || params_.frequency_penalty != 0.0) {
      for (const auto& [token, count] : counts_) {
        if (token < 0 || token >= vocab) continue;
        work_[static_cast<std::size_t>(token)] -=
            static_cast<float>(params_.presence_penalty + params_.frequency_penalty * static_cast<double>(count));
      }
    }
    for (const auto& b : params_.logit_bias) {
      if (b.token < vocab) work_[static_cast<std::size_t>(b.token)] += b.bias;
    }
    if (!allowed.empty()) {
      // Word by word: a grammar's mask is mostly all-zero words (skipped with one fill) or, inside a
      // string, all-one words (left alone), so this costs far less than a test per token.
      bool any = false;
      constexpr float kMasked = -std::numeric_limits<float>::infinity();
      for (std::size_t lo = 0; lo < work_.size(); lo += 64) {
        const std::uint64_t bits = allowed[lo / 64];
        const std::size_t hi = std::min(work_.size(), lo + 64);
        if (bits == 0) {
          std::fill(work_.begin() + static_cast<std::ptrdiff_t>(lo), work_.begin() + static_cast<std::ptrdiff_t>(hi),
                    kMasked);
          continue;
        }
        if (bits == ~std::uint64_t{0}) {
          any = true;
          continue;
        }
        for (std::size_t i = lo; i < hi; ++i) {
          if (((bits >> (i - lo)) & 1U) == 0) {
            work_[i] = kMasked;
          } else {
            any = true;
          }
        }
      }
      PD_CHECK_MSG(any, "Sampler: the allowed-token mask allows no token");
    }
  }
  SampledToken out;
  out.token = pick();
  if (!candidates_.empty()) out.token = candidates_[static_cast<std::size_t>(out.token)];
  if (!logprobs_) {
    observe(out.token);
    return out;
  }
  // Raw model logprobs.
  const float raw_max = logits[static_cast<std::size_t>(argmax(logits))];
  double sum = 0.0;
  for (const float v : logits) sum += std::exp(static_cast<double>(v) - raw_max);
  const double lse = static_cast<double>(raw_max) + std::log(sum);
  out.logprob = static_cast<float>(static_cast<double>(logits[static_cast<std::size_t>(out.token)]) - lse);
  if (params_.top_logprobs > 0) {
    const std::int64_t n = std::min(params_.top_logprobs, vocab);
    order_.resize(static_cast<std::size_t>(vocab));
    std::iota(order_.begin(), order_.end(), 0);
    std::partial_sort(order_.begin(), order_.begin() + n, order_.end(), [&](std::int32_t a, std::int32_t b) {
      const float va = logits[static_cast<std::size_t>(a)];
      const float vb = logits[static_cast<std::size_t>(b)];
      return va > vb || (va == vb && a < b);
    });
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int32_t tok = order_[static_cast<std::size_t>(i)];
      out.top.push_back({tok, static_cast<float>(static_cast<double>(logits[static_cast<std::size_t>(tok)]) - lse)});
    }
  }
  observe(out.token);
  return out;
}

}  // namespace pd::model
