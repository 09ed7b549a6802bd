// The CUDA engine (pd/engine/cuda_engine.h) against the CPU engine on the golden tiny-bf16 and
// tiny-fp8 checkpoints in the fp32 numerics mode, through the Engine seam: prefill chunks of
// several lengths (one longer than a device step, so it runs as two steps), a batch of two
// prompts, decode steps of mixed context lengths, MTP over a prompt and MTP verify (k+1 tokens of
// one sequence); logits and hidden states within the golden tolerance, greedy tokens equal, the
// sink's latents and the mirrored host cache equal to the CPU engine's. Also: the golden greedy
// tokens from model::generate (with and without MTP speculation) and from `pdserve generate
// --model.device cuda`; `pdserve logits --model.device cuda` within the golden tolerances; seeded sampling on the
// device (DeviceSampler through GenerateOptions::device_sampling) giving the CPU engine's host-sampled tokens; a bad
// batch is InvalidArgument with the host cache untouched; 1,000 forward calls leave device memory at its baseline.
// Where no device is visible the program prints why and exits 77 (ctest: skipped, never passed).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "device_ops.h"
#include "gpu/engine_test_util.h"
#include "gpu/gpu_test_main.h"
#include "pd/engine/cuda_engine.h"
#include "pd/engine/engine.h"
#include "pd/engine/generate.h"
#include "pd/engine/gpu.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/safetensors.h"
#include "support/cli_runner.h"

namespace {

namespace fs = std::filesystem;
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
constexpr i64 kBlockSize = 4;        // small, so chunks cross block boundaries
constexpr i64 kBlocks = 128;

std::unique_ptr<Engine> cpuEngine(const std::string& name) {
  pd::model::CpuEngineOptions o;
  o.threads = 1;
  o.prefault_weights = false;
  auto e = pd::model::createCpuEngine(golden(name), o);
  EXPECT_TRUE(e.ok()) << e.error().toString();
  return e.ok() ? std::move(e).value() : nullptr;
}

std::unique_ptr<Engine> cudaEngine(const std::string& name) {
  auto e = pd::model::createCudaEngine(golden(name), {});
  EXPECT_TRUE(e.ok()) << e.error().toString();
  return e.ok() ? std::move(e).value() : nullptr;
}

// Every latent a sink received, by (kv layer, sequence, position).
class RecordingSink final : public pd::model::LatentKvSink {
 public:
  explicit RecordingSink(i64 latent_dim) : ld_(latent_dim) {}
  void onLayer(i64 kv_layer, std::size_t sequence, i64 start_pos, std::span<const float> latent) override {
    const i64 n = static_cast<i64>(latent.size()) / ld_;
    for (i64 i = 0; i < n; ++i) {
      rows[{kv_layer, sequence, start_pos + i}].assign(latent.begin() + i * ld_, latent.begin() + (i + 1) * ld_);
    }
  }
  std::map<std::tuple<i64, std::size_t, i64>, std::vector<float>> rows;

 private:
  i64 ld_;
};

// Runs the same call on both engines (each on its own cache) and compares what comes back.
struct Pair {
  Engine& cpu;
  Engine& gpu;
  const pd::model::LatentCacheView& cpu_cache;
  const pd::model::LatentCacheView& gpu_cache;
  double worst_logits = 0.0;
  double worst_hidden = 0.0;
  double worst_latent = 0.0;

  std::pair<ForwardOutput, ForwardOutput> run(const std::vector<SequenceChunk>& batch, ForwardOptions o, bool mtp,
                                              const std::string& what) {
    const i64 ld = cpu.config().latentDim();
    RecordingSink cpu_sink(ld);
    RecordingSink gpu_sink(ld);
    o.sink = &cpu_sink;
    auto want = mtp ? cpu.forwardMtp(batch, cpu_cache, o) : cpu.forward(batch, cpu_cache, o);
    o.sink = &gpu_sink;
    auto got = mtp ? gpu.forwardMtp(batch, gpu_cache, o) : gpu.forward(batch, gpu_cache, o);
    EXPECT_TRUE(want.ok()) << what << ": " << want.error().toString();
    EXPECT_TRUE(got.ok()) << what << ": " << got.error().toString();
    if (!want.ok() || !got.ok()) return {};
    const double dl = maxAbsDiff(want->logits, got->logits);
    const double dh = maxAbsDiff(want->hidden, got->hidden);
    EXPECT_LE(dl, kTolerance) << what << ": logits";
    EXPECT_LE(dh, kTolerance) << what << ": hidden";
    worst_logits = std::max(worst_logits, dl);
    worst_hidden = std::max(worst_hidden, dh);
    EXPECT_EQ(cpu_sink.rows.size(), gpu_sink.rows.size()) << what << ": latents handed to the sink";
    for (const auto& [key, row] : cpu_sink.rows) {
      const auto it = gpu_sink.rows.find(key);
      if (it == gpu_sink.rows.end()) {
        ADD_FAILURE() << what << ": the CUDA engine's sink missed layer " << std::get<0>(key) << " sequence "
                      << std::get<1>(key) << " position " << std::get<2>(key);
        break;
      }
      const double d = maxAbsDiff(row, it->second);
      worst_latent = std::max(worst_latent, d);
      EXPECT_LE(d, kTolerance) << what << ": latent of layer " << std::get<0>(key) << " position " << std::get<2>(key);
    }
    const i64 vocab = cpu.config().vocab_size;
    const i64 rows = static_cast<i64>(want->logits.size()) / vocab;
    for (i64 r = 0; r < rows; ++r) {
      EXPECT_EQ(argmax(want->logits, r, vocab), argmax(got->logits, r, vocab)) << what << ": greedy token of row " << r;
    }
    return {std::move(want).value(), std::move(got).value()};
  }
};

SequenceChunk chunk(std::span<const std::int32_t> tokens, i64 start, std::span<const std::int32_t> table) {
  SequenceChunk s;
  s.tokens = tokens;
  s.start_pos = start;
  s.block_table = table;
  return s;
}

void expectCachesEqual(const pd::model::LatentCacheView& a, const pd::model::LatentCacheView& b,
                       std::span<const std::int32_t> table, i64 positions, i64 first_layer, i64 end_layer,
                       const std::string& what) {
  std::vector<float> x(static_cast<std::size_t>(a.latent_dim));
  std::vector<float> y(x.size());
  double worst = 0.0;
  for (i64 l = first_layer; l < end_layer; ++l) {
    for (i64 p = 0; p < positions; ++p) {
      pd::model::readLatent(a, l, table, p, x.data());
      pd::model::readLatent(b, l, table, p, y.data());
      worst = std::max(worst, maxAbsDiff(x, y));
    }
  }
  EXPECT_LE(worst, kTolerance) << what << ": the host cache the CUDA engine mirrors into";
}

void runParity(const std::string& name) {
  auto cpu = cpuEngine(name);
  auto gpu = cudaEngine(name);
  ASSERT_TRUE(cpu && gpu);
  const pd::ModelConfig& c = cpu->config();
  ASSERT_TRUE(gpu->capabilities().mtp) << "the golden checkpoints have an MTP layer";
  auto cpu_cache = pd::model::PagedLatentCache::create(c, kBlocks, kBlockSize, pd::DType::F32);
  auto gpu_cache = pd::model::PagedLatentCache::create(c, kBlocks, kBlockSize, pd::DType::F32);
  ASSERT_TRUE(cpu_cache.ok() && gpu_cache.ok());
  Pair pair{*cpu, *gpu, cpu_cache->view(), gpu_cache->view()};
  const i64 vocab = c.vocab_size;
  const i64 d = c.hidden_size;

  // Sequence A: 100 prompt tokens in chunks of 1, 5, 70 (two device steps) and 24; blocks
  // interleaved with the other sequences'. With AttentionPath::Auto the CPU engine takes the prefill
  // path for chunks of more than 16 tokens, the CUDA engine per step where it is cheaper.
  std::vector<std::int32_t> a_tokens;
  for (i64 i = 0; i < 100; ++i) a_tokens.push_back(static_cast<std::int32_t>((i * 37 + 5) % vocab));
  const auto a_table = blockTable(0, 30, 3);
  const auto b_table = blockTable(1, 30, 3);
  const auto c_table = blockTable(2, 30, 3);
  std::vector<float> a_hidden;  // CPU main-model final hidden of every prompt position
  ForwardOptions all;
  all.logits = OutputRows::All;
  all.hidden = OutputRows::All;
  i64 pos = 0;
  for (const i64 n : {1, 5, 70, 24}) {
    const std::vector<SequenceChunk> batch{
        chunk(std::span(a_tokens).subspan(static_cast<std::size_t>(pos), static_cast<std::size_t>(n)), pos, a_table)};
    auto [want, got] = pair.run(batch, all, false, name + " prefill chunk of " + std::to_string(n));
    a_hidden.insert(a_hidden.end(), want.hidden.begin(), want.hidden.end());
    pos += n;
  }
  ASSERT_EQ(static_cast<i64>(a_hidden.size()), 100 * d);

  // Sequences B and C: two prompts (7 and 19 tokens) in one call, Last logits, All hidden.
  const std::vector<std::int32_t> b_prompt{5, 17, 300, 42, 1000, 7, 2047};
  std::vector<std::int32_t> c_prompt;
  for (i64 i = 0; i < 19; ++i) c_prompt.push_back(static_cast<std::int32_t>((i * 101 + 3) % vocab));
  ForwardOptions last;
  last.logits = OutputRows::Last;
  last.hidden = OutputRows::All;
  pair.run({chunk(b_prompt, 0, b_table), chunk(c_prompt, 0, c_table)}, last, false, name + " two prompts");

  // Decode: A, B, C together for 6 steps (contexts 100, 7, 19 and growing), the CPU's greedy tokens.
  std::vector<i64> positions{100, 7, 19};
  std::vector<std::int32_t> next{a_tokens.back(), b_prompt.back(), c_prompt.back()};
  const std::vector<const std::vector<std::int32_t>*> tables{&a_table, &b_table, &c_table};
  ForwardOptions decode;
  decode.attention = pd::model::AttentionPath::Absorbed;
  decode.logits = OutputRows::Last;
  for (int step = 0; step < 6; ++step) {
    // Odd steps on the prefill attention path (three one-row segments), even ones absorbed.
    decode.attention = step % 2 == 1 ? pd::model::AttentionPath::Prefill : pd::model::AttentionPath::Absorbed;
    std::vector<SequenceChunk> batch;
    for (std::size_t s = 0; s < 3; ++s) {
      batch.push_back(chunk(std::span<const std::int32_t>(&next[s], 1), positions[s], *tables[s]));
    }
    auto [want, got] = pair.run(batch, decode, false, name + " decode step " + std::to_string(step));
    if (want.logits.empty()) return;
    for (std::size_t s = 0; s < 3; ++s) {
      next[s] = argmax(want.logits, static_cast<i64>(s), vocab);
      ++positions[s];
    }
  }

  // MTP verify: B's next token plus two drafts in one call, logits of all three rows.
  const std::vector<std::int32_t> verify{next[1], 11, 12};
  pair.run({chunk(verify, positions[1], b_table)}, all, false, name + " MTP verify (3 tokens)");

  // The MTP layer over A's prompt: row i = (token i+1, hidden i), 99 rows in chunks of 70 and 29.
  i64 mpos = 0;
  for (const i64 n : {70, 29}) {
    SequenceChunk m = chunk(
        std::span(a_tokens).subspan(static_cast<std::size_t>(mpos + 1), static_cast<std::size_t>(n)), mpos, a_table);
    m.prev_hidden = std::span(a_hidden).subspan(static_cast<std::size_t>(mpos * d), static_cast<std::size_t>(n * d));
    pair.run({m}, all, true, name + " MTP chunk of " + std::to_string(n));
    mpos += n;
  }
  // vLLM's zeroing of position 0's embedding (comparison only), on B's MTP layer.
  std::vector<float> b_hidden(static_cast<std::size_t>(2 * d), 0.25F);
  SequenceChunk zb = chunk(std::span(b_prompt).subspan(1, 2), 0, b_table);
  zb.prev_hidden = b_hidden;
  ForwardOptions zero = all;
  zero.mtp_zero_position0_embedding = true;
  pair.run({zb}, zero, true, name + " MTP with position 0 zeroed");

  expectCachesEqual(cpu_cache->view(), gpu_cache->view(), a_table, positions[0], 0, c.num_hidden_layers,
                    name + " sequence A");
  expectCachesEqual(cpu_cache->view(), gpu_cache->view(), a_table, 99, c.num_hidden_layers, c.kvLayers(),
                    name + " sequence A, MTP layer");
  expectCachesEqual(cpu_cache->view(), gpu_cache->view(), b_table, positions[1] + 3, 0, c.num_hidden_layers,
                    name + " sequence B");
  std::printf("%s: max |d| logits %.3g, hidden %.3g, latents %.3g\n", name.c_str(), pair.worst_logits,
              pair.worst_hidden, pair.worst_latent);
}

TEST(CudaEngine, TinyBf16MatchesTheCpuEngine) {
  runParity("tiny-bf16");
}

TEST(CudaEngine, TinyFp8MatchesTheCpuEngine) {
  runParity("tiny-fp8");
}

using StepCompare = std::function<void(const ForwardOutput& want, const ForwardOutput& got, const std::string& what)>;

// Greedy decode steps at positions [40, 48) after a 40-token prompt in `table`: each step's token
// (from `next`, then the `want` side's argmax) runs through `want_engine` on `want_cache` and
// `got_engine` on `got_cache`, and `compare` checks the pair. Returns the token after the last step.
std::int32_t decodeStepsBothWays(Engine& want_engine, const pd::model::LatentCacheView& want_cache, Engine& got_engine,
                                 const pd::model::LatentCacheView& got_cache, std::span<const std::int32_t> table,
                                 std::int32_t next, const StepCompare& compare) {
  const i64 vocab = want_engine.config().vocab_size;
  ForwardOptions last;
  last.logits = OutputRows::Last;
  for (i64 pos = 40; pos < 48; ++pos) {
    const std::vector<std::int32_t> token{next};
    const std::vector<SequenceChunk> step{chunk(token, pos, table)};
    auto w = want_engine.forward(step, want_cache, last);
    auto g = got_engine.forward(step, got_cache, last);
    EXPECT_TRUE(w.ok() && g.ok()) << "decode at " << pos;
    if (!w.ok() || !g.ok()) return next;
    compare(*w, *g, "decode at " + std::to_string(pos));
    next = argmax(w->logits, 0, vocab);
  }
  return next;
}

// A BF16 or FP8 host cache against the CPU engine on the same kind of cache, for a 40-token prompt
// (the prefill path on both) and 8 greedy decode steps. Both engines round every latent as the
// cache holds it, but where their unrounded latents differ in the last bits a rounding can flip,
// so the bound is the cache's own, not the float32 tolerance: for BF16 0.05 (docs/engine.md: close
// logits, the same greedy token unless the top two are close); for FP8 what FP8 itself moves the
// CPU engine's logits from an F32 cache (measured in the test), with the same token wherever the top
// two logits are 0.5 apart.
void runCacheParity(const std::string& model, pd::DType dtype) {
  auto cpu = cpuEngine(model);
  auto gpu = cudaEngine(model);
  ASSERT_TRUE(cpu && gpu);
  const pd::ModelConfig& c = cpu->config();
  const i64 vocab = c.vocab_size;
  auto cpu_cache = pd::model::PagedLatentCache::create(c, kBlocks, kBlockSize, dtype);
  auto gpu_cache = pd::model::PagedLatentCache::create(c, kBlocks, kBlockSize, dtype);
  auto f32_cache = pd::model::PagedLatentCache::create(c, kBlocks, kBlockSize, pd::DType::F32);
  ASSERT_TRUE(cpu_cache.ok() && gpu_cache.ok() && f32_cache.ok());
  std::vector<std::int32_t> prompt;
  for (i64 i = 0; i < 40; ++i) prompt.push_back(static_cast<std::int32_t>((i * 53 + 11) % vocab));
  const auto table = blockTable(0, 20, 1);
  ForwardOptions all;
  all.logits = OutputRows::All;  // 40 tokens: the prefill path on both (the cheaper one here)
  const std::vector<SequenceChunk> first{chunk(prompt, 0, table)};
  auto exact = cpu->forward(first, f32_cache->view(), all);
  auto want = cpu->forward(first, cpu_cache->view(), all);
  auto got = gpu->forward(first, gpu_cache->view(), all);
  ASSERT_TRUE(exact.ok() && want.ok() && got.ok());
  const bool fp8 = dtype == pd::DType::F8E4M3;
  const double bound = fp8 ? maxAbsDiff(exact->logits, want->logits) : 0.05;
  const float margin = fp8 ? 0.5F : 0.05F;
  double worst = 0.0;
  const auto compare = [&](const ForwardOutput& w, const ForwardOutput& g, const std::string& what) {
    worst = std::max(worst, maxAbsDiff(w.logits, g.logits));
    EXPECT_LE(maxAbsDiff(w.logits, g.logits), bound) << what;
    const i64 rows = static_cast<i64>(w.logits.size()) / vocab;
    for (i64 r = 0; r < rows; ++r) {
      std::vector<float> row(w.logits.begin() + r * vocab, w.logits.begin() + (r + 1) * vocab);
      std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<>());
      if (row[0] - row[1] > margin) {
        EXPECT_EQ(argmax(w.logits, r, vocab), argmax(g.logits, r, vocab)) << what << " row " << r;
      }
    }
  };
  compare(*want, *got, "prompt");
  decodeStepsBothWays(*cpu, cpu_cache->view(), *gpu, gpu_cache->view(), table, argmax(want->logits, 39, vocab),
                      compare);
  std::printf("%s on %s caches: max |d| logits %.3g (bound %.3g)\n", model.c_str(), pd::dtypeName(dtype).data(), worst,
              bound);
}

TEST(CudaEngine, ABf16HostCacheRunsOnABf16DeviceCacheNearTheCpuEngine) {
  runCacheParity("tiny-bf16", pd::DType::BF16);
}

// An FP8 host cache (e4m3 tiles, pd/common/kv_format.h): the device cache stays F32 and holds the
// FP8 values exactly (the step rounds each latent as the host cache stores it).
TEST(CudaEngine, AnFp8HostCacheAttendsToTheFp8ValuesAsTheCpuEngineDoes) {
  runCacheParity("tiny-bf16", pd::DType::F8E4M3);
  runCacheParity("tiny-fp8", pd::DType::F8E4M3);
}

// The device KV pool (Engine::allocateCache): GPU memory the step uses as its cache directly. A
// 40-token prompt and 8 greedy decode steps give bit-equal logits on it and on a host cache of the
// same dtype (the mirrored path: the same values reach the same kernels), for BF16, FP8 and F32; a
// block copied through the pool's memory reads as the original; the CPU engine refuses the pool.
TEST(CudaEngine, DeviceKvPoolGivesTheHostCachesLogits) {
  auto gpu = cudaEngine("tiny-bf16");
  auto cpu = cpuEngine("tiny-bf16");
  ASSERT_TRUE(gpu && cpu);
  const pd::ModelConfig& c = gpu->config();
  const i64 vocab = c.vocab_size;
  std::vector<std::int32_t> prompt;
  for (i64 i = 0; i < 40; ++i) prompt.push_back(static_cast<std::int32_t>((i * 53 + 11) % vocab));
  for (const pd::DType dtype : {pd::DType::BF16, pd::DType::F8E4M3, pd::DType::F32}) {
    auto host = pd::model::PagedLatentCache::create(c, kBlocks, kBlockSize, dtype);
    ASSERT_TRUE(host.ok());
    auto pool = gpu->allocateCache(kBlocks, kBlockSize, dtype);
    ASSERT_TRUE(pool.ok()) << pool.error().toString();
    EXPECT_TRUE((*pool)->view().on_device);
    EXPECT_EQ((*pool)->location(), "cuda:0");
    const auto table = blockTable(0, 20, 1);
    ForwardOptions all;
    all.logits = OutputRows::All;
    const std::vector<SequenceChunk> first{chunk(prompt, 0, table)};
    auto want = gpu->forward(first, host->view(), all);
    auto got = gpu->forward(first, (*pool)->view(), all);
    ASSERT_TRUE(want.ok() && got.ok()) << (got.ok() ? want.error().toString() : got.error().toString());
    EXPECT_EQ(maxAbsDiff(want->logits, got->logits), 0.0) << pd::dtypeName(dtype) << " prompt";
    // The pool holds the bytes the host cache holds (read back as a prefill worker ships a cached
    // prefix: CacheMemory::readLatents, a copy from the device).
    {
      std::vector<float> a(static_cast<std::size_t>(40 * c.latentDim()));
      std::vector<float> b(a.size());
      for (i64 p = 0; p < 40; ++p) pd::model::readLatent(host->view(), 1, table, p, a.data() + p * c.latentDim());
      ASSERT_TRUE((*pool)->readLatents(1, table, 40, b.data()).ok());
      EXPECT_EQ(maxAbsDiff(a, b), 0.0) << pd::dtypeName(dtype) << " cached latents";
    }
    const std::int32_t next =
        decodeStepsBothWays(*gpu, host->view(), *gpu, (*pool)->view(), table, argmax(want->logits, 39, vocab),
                            [&](const ForwardOutput& w, const ForwardOutput& g, const std::string& what) {
                              EXPECT_EQ(maxAbsDiff(w.logits, g.logits), 0.0) << pd::dtypeName(dtype) << " " << what;
                            });
    ForwardOptions last;
    last.logits = OutputRows::Last;
    // Block 0 copied into block 30 through the pool's memory: a table naming 30 instead reads the same.
    ASSERT_TRUE((*pool)->copyBlock(0, 30).ok());
    auto moved = blockTable(0, 20, 1);
    moved[0] = 30;
    const std::vector<std::int32_t> token{next};
    auto a = gpu->forward(std::vector<SequenceChunk>{chunk(token, 48, table)}, (*pool)->view(), last);
    auto b = gpu->forward(std::vector<SequenceChunk>{chunk(token, 48, moved)}, (*pool)->view(), last);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(maxAbsDiff(a->logits, b->logits), 0.0) << pd::dtypeName(dtype) << " after a block copy";
    auto refused = cpu->forward(first, (*pool)->view(), all);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.error().code, pd::ErrorCode::InvalidArgument);
  }
}

std::vector<std::int32_t> goldenIds(const std::string& name, const std::string& tensor) {
  auto g = pd::SafetensorsFile::open(golden(name) / "golden.safetensors");
  EXPECT_TRUE(g.ok());
  if (!g.ok()) return {};
  const pd::TensorView* t = g->find(tensor);
  EXPECT_NE(t, nullptr) << tensor;
  if (t == nullptr) return {};
  std::vector<std::int64_t> v(static_cast<std::size_t>(t->numel()));
  std::memcpy(v.data(), t->data.data(), t->data.size());
  return {v.begin(), v.end()};
}

TEST(CudaEngine, GenerateGivesTheGoldenGreedyTokens) {
  for (const std::string name : {"tiny-bf16", "tiny-fp8"}) {
    auto gpu = cudaEngine(name);
    ASSERT_TRUE(gpu);
    const std::vector<std::int32_t> prompt = goldenIds(name, "p0.tokens");
    const std::vector<std::int32_t> want = goldenIds(name, "p0.greedy");
    ASSERT_FALSE(want.empty());
    for (const std::int64_t drafts : {0, 2}) {
      pd::model::GenerateOptions o;
      o.max_tokens = static_cast<std::int64_t>(want.size());
      o.mtp_drafts = drafts;
      o.stop_at_eos = false;
      o.prefill_chunk = 16;
      auto got = pd::model::generate(*gpu, prompt, o);
      ASSERT_TRUE(got.ok()) << got.error().toString();
      EXPECT_EQ(got->tokens, want) << name << " with " << drafts << " MTP drafts";
    }
    // Sampled on the device (only ids and logprobs come back): the host Sampler's tokens.
    auto cpu = cpuEngine(name);
    ASSERT_TRUE(cpu);
    for (const std::int64_t drafts : {0, 2}) {
      pd::model::GenerateOptions o;
      o.max_tokens = 16;
      o.mtp_drafts = drafts;
      o.stop_at_eos = false;
      o.sampling.temperature = 0.9;
      o.sampling.top_k = 50;
      o.sampling.presence_penalty = 0.4;
      o.sampling.seed = 11;
      auto host = pd::model::generate(*cpu, prompt, o);
      ASSERT_TRUE(host.ok()) << host.error().toString();
      o.device_sampling = true;
      auto sampled = pd::model::generate(*gpu, prompt, o);
      ASSERT_TRUE(sampled.ok()) << sampled.error().toString();
      EXPECT_EQ(sampled->tokens, host->tokens) << name << ": device sampling with " << drafts << " MTP drafts";
    }
    // The command line, as a user runs it.
    std::string ids;
    for (const std::int32_t t : prompt) ids += (ids.empty() ? "" : ",") + std::to_string(t);
    const auto r = pd::test::pdserveCommandLine("generate --model " + golden(name).string() +
                                                " --model.device cuda --prompt-ids " + ids + " --max-tokens " +
                                                std::to_string(want.size()));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    std::string want_json = "{\"ids\": [";
    for (std::size_t i = 0; i < want.size(); ++i) want_json += (i ? ", " : "") + std::to_string(want[i]);
    EXPECT_EQ(r.out, want_json + "]}\n") << name;
  }
}

std::vector<float> floats(const pd::SafetensorsFile& f, const std::string& name) {
  const pd::TensorView* t = f.find(name);
  if (t == nullptr || t->dtype != pd::DType::F32) return {};
  std::vector<float> v(static_cast<std::size_t>(t->numel()));
  std::memcpy(v.data(), t->data.data(), t->data.size());
  return v;
}

// `pdserve logits --model.device cuda` writes the golden tensors within the golden tolerances
// (the same bounds the CPU engine's command meets in tests/integration/test_cli_model.cpp).
TEST(CudaEngine, LogitsCommandWritesTheGoldenTensors) {
  for (const std::string name : {"tiny-bf16", "tiny-fp8"}) {
    auto g = pd::SafetensorsFile::open(golden(name) / "golden.safetensors");
    ASSERT_TRUE(g.ok());
    std::string ids;
    for (const std::int32_t t : goldenIds(name, "p0.tokens")) ids += (ids.empty() ? "" : ",") + std::to_string(t);
    const fs::path out =
        fs::temp_directory_path() / ("pd_cuda_logits_" + name + "_" + std::to_string(::getpid()) + ".safetensors");
    const auto r = pd::test::pdserveCommandLine("logits --model " + golden(name).string() +
                                                " --model.device cuda --prompt-ids " + ids + " --out " + out.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto written = pd::SafetensorsFile::open(out);
    ASSERT_TRUE(written.ok());
    for (const auto& [tensor, tol] : std::vector<std::pair<std::string, double>>{{"logits_all", 1e-3},
                                                                                 {"kv_cache", 2e-4},
                                                                                 {"pe_cache", 2e-4},
                                                                                 {"hidden_final", 2e-4},
                                                                                 {"mtp_logits_nozero", 1e-3}}) {
      const std::vector<float> got = floats(*written, tensor);
      const std::vector<float> want = floats(*g, "p0." + tensor);
      ASSERT_FALSE(got.empty()) << name << " " << tensor;
      ASSERT_LE(got.size(), want.size()) << tensor;  // mtp_logits_nozero: the first N rows
      double d = 0.0;
      for (std::size_t i = 0; i < got.size(); ++i) d = std::max(d, std::fabs(double{got[i]} - double{want[i]}));
      EXPECT_LE(d, tol) << name << " " << tensor;
      std::printf("%s %s: max |d| %.3g against the golden\n", name.c_str(), tensor.c_str(), d);
    }
    fs::remove(out);
  }
}

TEST(CudaEngine, BadBatchIsRefusedWithNothingWritten) {
  auto gpu = cudaEngine("tiny-bf16");
  ASSERT_TRUE(gpu);
  const pd::ModelConfig& c = gpu->config();
  auto cache = pd::model::PagedLatentCache::create(c, 8, kBlockSize, pd::DType::F32);
  ASSERT_TRUE(cache.ok());
  const std::vector<std::int32_t> table{0, 1};
  const std::vector<std::int32_t> prompt{1, 2, 3};
  ASSERT_TRUE(gpu->forward({{chunk(prompt, 0, table)}}, cache->view(), {}).ok());
  std::vector<std::byte> before(cache->view().layers[0], cache->view().layers[0] + cache->bytes());
  const std::vector<std::int32_t> bad{4, static_cast<std::int32_t>(c.vocab_size)};
  auto r = gpu->forward({{chunk(bad, 3, table)}}, cache->view(), {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, pd::ErrorCode::InvalidArgument);
  const std::vector<std::int32_t> short_table{0};
  auto r2 = gpu->forward({{chunk(prompt, 3, short_table)}}, cache->view(), {});
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_EQ(std::memcmp(before.data(), cache->view().layers[0], before.size()), 0) << "a refused batch wrote";
  const std::vector<std::int32_t> good{4};
  EXPECT_TRUE(gpu->forward({{chunk(good, 3, table)}}, cache->view(), {}).ok()) << "unusable after a refusal";
}

TEST(CudaEngine, DeviceMemoryStaysFlatOverAThousandCalls) {
  auto gpu = cudaEngine("tiny-bf16");
  ASSERT_TRUE(gpu);
  const pd::ModelConfig& c = gpu->config();
  auto cache = pd::model::PagedLatentCache::create(c, 16, kBlockSize, pd::DType::F32);
  ASSERT_TRUE(cache.ok());
  const std::vector<std::int32_t> table{3, 7, 1, 0};
  const std::vector<std::int32_t> prompt{9, 8, 7, 6, 5, 4, 3, 2};
  ASSERT_TRUE(gpu->forward({{chunk(prompt, 0, table)}}, cache->view(), {}).ok());
  std::int64_t baseline = 0;
  for (int call = 0; call < 1000; ++call) {
    const std::int32_t token = static_cast<std::int32_t>(call % c.vocab_size);
    auto r = gpu->forward({{chunk(std::span<const std::int32_t>(&token, 1), 8 + call % 8, table)}}, cache->view(), {});
    ASSERT_TRUE(r.ok()) << "call " << call << ": " << r.error().toString();
    if (call == 9) {
      auto info = pd::gpu::deviceMemoryInfo();
      ASSERT_TRUE(info.ok());
      baseline = static_cast<std::int64_t>(info->free);
    }
  }
  auto info = pd::gpu::deviceMemoryInfo();
  ASSERT_TRUE(info.ok());
  const std::int64_t lost = baseline - static_cast<std::int64_t>(info->free);
  std::printf("device memory after 1000 calls: %lld bytes fewer free than after 10\n", static_cast<long long>(lost));
  EXPECT_LT(lost, std::int64_t{8} << 20) << "device memory grew";
}

}  // namespace

int main(int argc, char** argv) {
  return pd::testutil::runGpuTests(argc, argv, "the CUDA engine tests");
}
