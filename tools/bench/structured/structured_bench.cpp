// pd_bench_structured: what grammar-constrained decoding costs per token on the real DeepSeek-V3
// vocabulary (docs/benchmarks.md).
//
//   pd_bench_structured --tokenizer DIR --suite FILE [--generations N] [--vocab-size N] [--seed N]
//
// Loads the tokenizer and the token vocabulary (timed once each), compiles every schema of the
// suite (tests/data/structured/schema_suite.jsonl), and runs N generations per schema sampling
// uniformly among the allowed tokens (a random-weight model under the mask), timing every
// Matcher::fillMask in thread CPU time (so a step preempted on a shared machine is not counted). Prints p50/p99/max per
// schema and over all steps, and the ceiling measured in the same run: one pass over a mask's words (OR of a
// precomputed mask), the least any bitmask method pays per token.
#include <algorithm>
#include <bit>
#include <boost/json.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "pd/structured/grammar.h"
#include "pd/tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
using pd::TokenId;
using pd::structured::Grammar;
using pd::structured::GrammarOptions;
using pd::structured::MaskWord;
using pd::structured::Matcher;
using pd::structured::TokenVocabulary;

struct Args {
  std::string tokenizer_dir;
  std::string suite;
  int generations = 50;
  std::size_t vocab_size = 129280;
  std::uint64_t seed = 1;
};

double micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

// This thread's CPU time in microseconds: a step's cost without the time the scheduler gave the
// core to someone else (the build machines are shared; a preempted step reads 4 ms of wall time).
double threadMicros() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(std::lround(p * static_cast<double>(v.size() - 1)));
  return v[std::min(i, v.size() - 1)];
}

TokenId nthAllowed(const std::vector<MaskWord>& mask, std::size_t k) {
  for (std::size_t w = 0; w < mask.size(); ++w) {
    const auto n = static_cast<std::size_t>(std::popcount(mask[w]));
    if (k >= n) {
      k -= n;
      continue;
    }
    MaskWord word = mask[w];
    for (std::size_t i = 0; i < k; ++i) word &= word - 1;
    return static_cast<TokenId>(w * 64 + static_cast<std::size_t>(std::countr_zero(word)));
  }
  return -1;
}

int usage() {
  std::fprintf(stderr,
               "usage: pd_bench_structured --tokenizer DIR --suite FILE [--generations N] [--vocab-size N] "
               "[--seed N]\n");
  return 2;
}

int run(int argc, char** argv) {
  Args args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    const std::string value = argv[i + 1];
    if (key == "--tokenizer") {
      args.tokenizer_dir = value;
    } else if (key == "--suite") {
      args.suite = value;
    } else if (key == "--generations") {
      args.generations = std::stoi(value);
    } else if (key == "--vocab-size") {
      args.vocab_size = std::stoull(value);
    } else if (key == "--seed") {
      args.seed = std::stoull(value);
    } else {
      return usage();
    }
  }
  if (args.tokenizer_dir.empty() || args.suite.empty() || argc % 2 == 0) return usage();

  auto t0 = Clock::now();
  auto tokenizer = pd::tokenizer::Tokenizer::load(args.tokenizer_dir);
  const double load_ms = micros(Clock::now() - t0) / 1000.0;
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", tokenizer.error().toString().c_str());
    return 1;
  }
  t0 = Clock::now();
  auto vocab = TokenVocabulary::fromTokenizer(tokenizer.value(), args.vocab_size);
  const double vocab_ms = micros(Clock::now() - t0) / 1000.0;
  if (!vocab.ok()) {
    std::fprintf(stderr, "%s\n", vocab.error().toString().c_str());
    return 1;
  }
  std::printf("tokenizer load: %.1f ms; token vocabulary (trie + plain-string masks): %.1f ms; %zu ids\n", load_ms,
              vocab_ms, vocab.value()->size());

  // The ceiling: one pass over a mask's words, as the cheapest possible mask costs.
  std::vector<MaskWord> mask(vocab.value()->maskWords());
  std::vector<MaskWord> other(mask.size(), 0x5555555555555555ULL);
  std::vector<double> ceiling;
  for (int r = 0; r < 2000; ++r) {
    const double s = threadMicros();
    for (std::size_t i = 0; i < mask.size(); ++i) mask[i] |= other[i];
    ceiling.push_back(threadMicros() - s);
    other[static_cast<std::size_t>(r) % other.size()] ^= mask[0];
  }
  const double ceiling_p50 = percentile(ceiling, 0.5);

  GrammarOptions options;
  options.unbounded_string_chars = 32;  // as the test suite: random sampling never closes a free string
  std::ifstream in(args.suite);
  std::string line;
  std::vector<double> all;
  std::mt19937_64 rng(args.seed);
  std::printf("%-16s %8s %8s %9s %9s %9s %9s\n", "schema", "compile", "tokens", "p50_us", "p99_us", "max_us",
              "mean_us");
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto row = boost::json::parse(line).as_object();
    const std::string name(row.at("name").as_string());
    t0 = Clock::now();
    auto grammar = row.contains("schema")
                       ? Grammar::fromJsonSchema(boost::json::serialize(row.at("schema")), vocab.value(), options)
                       : Grammar::anyJsonObject(vocab.value(), options);
    const double compile_us = micros(Clock::now() - t0);
    if (!grammar.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), grammar.error().toString().c_str());
      return 1;
    }
    std::vector<double> times;
    for (int g = 0; g < args.generations; ++g) {
      Matcher m(grammar.value());
      for (int step = 0; step < 5000; ++step) {
        const double s = threadMicros();
        m.fillMask(mask);
        times.push_back(threadMicros() - s);
        std::size_t n = 0;
        for (const auto w : mask) n += static_cast<std::size_t>(std::popcount(w));
        const TokenId t = nthAllowed(mask, rng() % n);
        if (!m.accept(t).ok()) return 1;
        if (m.isTerminated()) break;
      }
    }
    double sum = 0;
    for (const double t : times) sum += t;
    std::printf("%-16s %6.0fus %8zu %9.1f %9.1f %9.1f %9.1f\n", name.c_str(), compile_us, times.size(),
                percentile(times, 0.5), percentile(times, 0.99), percentile(times, 1.0),
                sum / static_cast<double>(times.size()));
    all.insert(all.end(), times.begin(), times.end());
  }
  std::printf(
      "all steps: %zu masks, p50 %.1f us, p99 %.1f us; ceiling (one OR pass over %zu words) p50 %.2f us, "
      "p50 / ceiling = %.1fx\n",
      all.size(), percentile(all, 0.5), percentile(all, 0.99), mask.size(), ceiling_p50,
      percentile(all, 0.5) / std::max(ceiling_p50, 1e-3));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // std::stoi on a bad number, an allocation failure
    std::fprintf(stderr, "pd_bench_structured: %s\n", e.what());
    return 1;
  }
}
