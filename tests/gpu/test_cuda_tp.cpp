// Tensor parallelism in the CUDA engine (CudaEngineOptions::tp; docs/tensor-parallel.md, "On
// GPUs") on the one GPU a check machine has: two ranks are two threads of a loopback group, each
// with its own CudaEngine on the same device holding its shard of the golden checkpoint (heads,
// MLP and expert widths, vocabulary rows; tiny-fp8's expert slices re-block their FP8 scales).
// NCCL refuses two ranks on one device, so the collectives are the staged ones (device -> host
// -> loopback sum -> device). Both ranks replay the same calls (prompt chunks on either attention
// path, a batch of two prompts, greedy decode steps, MTP): every rank's logits and hidden states
// must equal rank 0's bit for bit, and rank 0's must lie within the golden tolerance of the
// unsharded CPU engine with the same greedy tokens. Where no device is visible the program says so
// and exits 77 (ctest: skipped).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu/engine_test_util.h"
#include "gpu/gpu_test_main.h"
#include "pd/comm/communicator.h"
#include "pd/engine/cuda_engine.h"
#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"

namespace {

using pd::model::Engine;
using pd::model::ForwardOptions;
using pd::model::ForwardOutput;
using pd::model::OutputRows;
using pd::model::SequenceChunk;
using pd::testutil::argmax;
using pd::testutil::blockTable;
using pd::testutil::golden;
using pd::testutil::maxAbsDiff;
using i64 = std::int64_t;

constexpr double kTolerance = 1e-3;  // tests/data/golden/README.md, float32 implementations
constexpr i64 kBlockSize = 4;
constexpr i64 kBlocks = 96;

// One sequence of a call: its tokens, first position, block table and (MTP) previous hidden.
struct Part {
  std::vector<std::int32_t> tokens;
  i64 start = 0;
  std::vector<std::int32_t> table;
  std::vector<float> prev_hidden;
};
struct Call {
  std::vector<Part> parts;
  ForwardOptions options;
  bool mtp = false;
  std::string what;
};

pd::Result<ForwardOutput> runCall(Engine& e, const pd::model::LatentCacheView& cache, const Call& call) {
  std::vector<SequenceChunk> batch;
  for (const Part& p : call.parts) {
    SequenceChunk s;
    s.tokens = p.tokens;
    s.start_pos = p.start;
    s.block_table = p.table;
    s.prev_hidden = p.prev_hidden;
    batch.push_back(s);
  }
  return call.mtp ? e.forwardMtp(batch, cache, call.options) : e.forward(batch, cache, call.options);
}

// The calls, with the CPU engine's outputs: decode tokens are the CPU's greedy choices, the MTP
// rows take the CPU's hidden states, so every engine replays exactly these calls.
void planCalls(Engine& cpu, std::vector<Call>& calls, std::vector<ForwardOutput>& want) {
  const pd::ModelConfig& c = cpu.config();
  const i64 vocab = c.vocab_size;
  auto cache = pd::model::PagedLatentCache::create(c, kBlocks, kBlockSize, pd::DType::F32);
  ASSERT_TRUE(cache.ok()) << cache.error().toString();
  const auto run = [&](Call call) {
    auto out = runCall(cpu, cache->view(), call);
    ASSERT_TRUE(out.ok()) << call.what << ": " << out.error().toString();
    calls.push_back(std::move(call));
    want.push_back(std::move(out).value());
  };
  const auto a_table = blockTable(0, 30, 3);
  const auto b_table = blockTable(1, 30, 3);
  const auto c_table = blockTable(2, 30, 3);
  std::vector<std::int32_t> a;
  for (i64 i = 0; i < 40; ++i) a.push_back(static_cast<std::int32_t>((i * 37 + 5) % vocab));
  ForwardOptions all;
  all.logits = OutputRows::All;
  all.hidden = OutputRows::All;
  // A's prompt in two chunks: the first on the prefill attention path, the second absorbed.
  all.attention = pd::model::AttentionPath::Prefill;
  run({{{{a.begin(), a.begin() + 23}, 0, a_table, {}}}, all, false, "A chunk [0, 23), prefill path"});
  all.attention = pd::model::AttentionPath::Absorbed;
  run({{{{a.begin() + 23, a.end()}, 23, a_table, {}}}, all, false, "A chunk [23, 40), absorbed"});
  std::vector<float> a_hidden = want[0].hidden;
  a_hidden.insert(a_hidden.end(), want[1].hidden.begin(), want[1].hidden.end());
  // B and C: two prompts in one call.
  const std::vector<std::int32_t> b{5, 17, 300, 42, 1000, 7, 2047};
  std::vector<std::int32_t> cp;
  for (i64 i = 0; i < 19; ++i) cp.push_back(static_cast<std::int32_t>((i * 101 + 3) % vocab));
  ForwardOptions last;
  last.logits = OutputRows::Last;
  last.hidden = OutputRows::All;
  run({{{b, 0, b_table, {}}, {cp, 0, c_table, {}}}, last, false, "B and C prompts"});
  // Four greedy decode steps of A, B and C, alternating attention paths.
  std::vector<i64> pos{40, 7, 19};
  std::vector<std::int32_t> next{a.back(), b.back(), cp.back()};
  const std::vector<const std::vector<std::int32_t>*> tables{&a_table, &b_table, &c_table};
  for (int step = 0; step < 4; ++step) {
    ForwardOptions decode;
    decode.logits = OutputRows::Last;
    decode.attention = step % 2 == 1 ? pd::model::AttentionPath::Prefill : pd::model::AttentionPath::Absorbed;
    Call call{{}, decode, false, "decode step " + std::to_string(step)};
    for (std::size_t s = 0; s < 3; ++s) call.parts.push_back({{next[s]}, pos[s], *tables[s], {}});
    run(std::move(call));
    for (std::size_t s = 0; s < 3; ++s) {
      next[s] = argmax(want.back().logits, static_cast<i64>(s), vocab);
      ++pos[s];
    }
  }
  // The MTP layer over A's prompt: row i = (token i + 1, hidden i).
  const i64 d = c.hidden_size;
  Part m{{a.begin() + 1, a.end()}, 0, a_table, {a_hidden.begin(), a_hidden.begin() + 39 * d}};
  run({{m}, all, true, "MTP over A's prompt"});
}

void runTensorParallel(const std::string& name, int ranks) {
  pd::model::CpuEngineOptions co;
  co.threads = 1;
  co.prefault_weights = false;
  auto cpu = pd::model::createCpuEngine(golden(name), co);
  ASSERT_TRUE(cpu.ok()) << cpu.error().toString();
  std::vector<Call> calls;
  std::vector<ForwardOutput> want;
  planCalls(**cpu, calls, want);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());

  pd::comm::LoopbackOptions lo;
  lo.timeout = std::chrono::seconds(120);  // a failed rank fails its peers' next collective, never hangs them
  auto group = pd::comm::createLoopbackGroup(ranks, lo);
  std::vector<std::vector<ForwardOutput>> got(static_cast<std::size_t>(ranks));
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  std::vector<std::string> backends(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      const auto ri = static_cast<std::size_t>(r);
      pd::model::CudaEngineOptions o;
      o.tp = group[ri].get();
      auto engine = pd::model::createCudaEngine(golden(name), o);
      if (!engine.ok()) {
        errors[ri] = "create: " + engine.error().toString();
        return;
      }
      backends[ri] = (*engine)->capabilities().backend;
      auto cache = pd::model::PagedLatentCache::create((*engine)->config(), kBlocks, kBlockSize, pd::DType::F32);
      if (!cache.ok()) {
        errors[ri] = cache.error().toString();
        return;
      }
      for (const Call& call : calls) {
        auto out = runCall(**engine, cache->view(), call);
        if (!out.ok()) {
          errors[ri] = call.what + ": " + out.error().toString();
          return;
        }
        got[ri].push_back(std::move(out).value());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    const auto ri = static_cast<std::size_t>(r);
    ASSERT_TRUE(errors[ri].empty()) << name << " rank " << r << ": " << errors[ri];
    EXPECT_NE(backends[ri].find("tensor-parallel rank " + std::to_string(r) + " of " + std::to_string(ranks)),
              std::string::npos)
        << backends[ri];
    ASSERT_EQ(got[ri].size(), calls.size());
  }
  const i64 vocab = (*cpu)->config().vocab_size;
  double worst_logits = 0.0;
  double worst_hidden = 0.0;
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const std::string& what = calls[i].what;
    for (std::size_t r = 1; r < got.size(); ++r) {
      EXPECT_EQ(got[r][i].logits, got[0][i].logits) << name << " " << what << ": rank " << r << "'s logits";
      EXPECT_EQ(got[r][i].hidden, got[0][i].hidden) << name << " " << what << ": rank " << r << "'s hidden";
    }
    const double dl = maxAbsDiff(want[i].logits, got[0][i].logits);
    const double dh = maxAbsDiff(want[i].hidden, got[0][i].hidden);
    EXPECT_LE(dl, kTolerance) << name << " " << what << ": logits against the CPU engine";
    EXPECT_LE(dh, kTolerance) << name << " " << what << ": hidden against the CPU engine";
    worst_logits = std::max(worst_logits, dl);
    worst_hidden = std::max(worst_hidden, dh);
    const i64 rows = static_cast<i64>(want[i].logits.size()) / vocab;
    for (i64 row = 0; row < rows; ++row) {
      EXPECT_EQ(argmax(want[i].logits, row, vocab), argmax(got[0][i].logits, row, vocab))
          << name << " " << what << ": greedy token of row " << row;
    }
  }
  std::printf("%s, %d ranks on one GPU: max |d| logits %.3g, hidden %.3g against the CPU engine\n", name.c_str(), ranks,
              worst_logits, worst_hidden);
}

TEST(CudaTensorParallel, TinyBf16TwoRanksMatchTheCpuEngine) {
  runTensorParallel("tiny-bf16", 2);
}

TEST(CudaTensorParallel, TinyFp8TwoRanksMatchTheCpuEngine) {
  runTensorParallel("tiny-fp8", 2);
}

TEST(CudaTensorParallel, TinyBf16FourRanksMatchTheCpuEngine) {
  runTensorParallel("tiny-bf16", 4);
}

}  // namespace

int main(int argc, char** argv) {
  return pd::testutil::runGpuTests(argc, argv, "the CUDA tensor-parallel tests");
}
