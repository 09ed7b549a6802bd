// pdserve bench engine: the CPU engine's speed as ratios to ceilings measured in the same run,
// with the same threads (DESIGN §7):
//  - decode at several batch sizes: bytes a step must read (non-expert weights + the routed
//    experts actually selected + LM head + latent KV, as the engine counts them) / step time,
//    over the read bandwidth of a streaming pass over a buffer far larger than the caches;
//  - prefill: FLOPs the engine performed / time, over the FMA throughput of a register-only loop.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "cli.h"
#include "pd/engine/engine.h"
#include "pd/engine/kernels.h"
#include "pd/engine/thread_pool.h"

namespace pd::cli {
namespace {

using Clock = BenchClock;

// Best-of-3 FMA throughput of all threads, in FLOP/s.
double measurePeakFlops(model::ThreadPool& pool, const model::KernelTable& k) {
  const std::int64_t iterations = 20'000'000;
  const std::int64_t tasks = pool.size();
  std::vector<float> sink(static_cast<std::size_t>(tasks));
  double best = 0.0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    pool.run(tasks, [&](std::int64_t t) { sink[static_cast<std::size_t>(t)] = k.fmaLoop(iterations); });
    const double flops = static_cast<double>(iterations) * static_cast<double>(k.fma_loop_flops_per_iteration) *
                         static_cast<double>(tasks);
    best = std::max(best, flops / secondsSince(t0));
  }
  return best;
}

struct DecodeResult {
  std::int64_t batch = 0;
  double cpu_share = 0.0;     // CPU time / (wall time x threads) over the timed steps
  double step_seconds = 0.0;  // median
  double bytes_per_step = 0.0;
  double mbu = 0.0;
  std::int64_t experts_per_step = 0;
};

Result<DecodeResult> benchDecode(model::Engine& engine, std::int64_t batch, std::int64_t context, std::int64_t steps,
                                 double bandwidth, int threads, std::mt19937& rng) {
  const ModelConfig& cfg = engine.config();
  constexpr std::int64_t kBlock = 64;
  const std::int64_t positions = context + steps + 2;
  const std::int64_t per_seq = (positions + kBlock - 1) / kBlock;
  PD_ASSIGN_OR_RETURN(model::PagedLatentCache cache, model::PagedLatentCache::create(cfg, batch * per_seq, kBlock));
  std::vector<std::vector<std::int32_t>> tables(static_cast<std::size_t>(batch));
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> latent(static_cast<std::size_t>(cfg.latentDim()));
  for (std::int64_t s = 0; s < batch; ++s) {
    auto& t = tables[static_cast<std::size_t>(s)];
    t.resize(static_cast<std::size_t>(per_seq));
    std::iota(t.begin(), t.end(), static_cast<std::int32_t>(s * per_seq));
    // A synthetic context: random latents (the step's cost does not depend on their values).
    for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
      for (std::int64_t p = 0; p < context; ++p) {
        for (float& v : latent) v = normal(rng);
        model::writeLatent(cache.view(), l, t, p, latent.data());
      }
    }
  }
  std::uniform_int_distribution<std::int32_t> token(2, static_cast<std::int32_t>(cfg.vocab_size - 1));
  std::vector<std::int32_t> feed(static_cast<std::size_t>(batch));
  std::vector<double> times;
  DecodeResult r;
  r.batch = batch;
  for (std::int64_t step = 0; step < steps + 2; ++step) {
    std::vector<model::SequenceChunk> chunks;
    for (std::int64_t s = 0; s < batch; ++s) {
      feed[static_cast<std::size_t>(s)] = token(rng);
      chunks.push_back({std::span<const std::int32_t>(&feed[static_cast<std::size_t>(s)], 1), context + step,
                        tables[static_cast<std::size_t>(s)]});
    }
    model::ForwardOptions o;
    o.attention = model::AttentionPath::Absorbed;
    o.logits = model::OutputRows::Last;
    const auto t0 = Clock::now();
    const double c0 = processCpuSeconds();
    PD_ASSIGN_OR_RETURN(model::ForwardOutput out, engine.forward(chunks, cache.view(), o));
    const double dt = secondsSince(t0);
    if (step < 2) continue;  // warm-up: page faults, workspace growth
    times.push_back(dt);
    r.cpu_share += (processCpuSeconds() - c0) / (dt * threads) / static_cast<double>(steps);
    r.bytes_per_step += static_cast<double>(out.stats.weight_bytes + out.stats.kv_bytes) / static_cast<double>(steps);
    r.experts_per_step += out.stats.experts_used;
  }
  std::sort(times.begin(), times.end());
  r.step_seconds = times[times.size() / 2];
  r.experts_per_step /= steps;
  r.mbu = r.bytes_per_step / r.step_seconds / bandwidth;
  return r;
}

}  // namespace

int runBenchEngine(const std::vector<std::string>& args) {
  CommonConfig common;
  CommonOptions common_sets(common);
  std::filesystem::path model_dir;
  std::int64_t threads = 0;
  std::string isa_name = "auto";
  std::string batches_text = "1,4,16,64";
  std::int64_t context = 256;
  std::int64_t steps = 8;
  std::int64_t prefill_tokens = 512;
  std::int64_t bandwidth_mb = 2048;
  bool json = false;
  config::OptionSet set("bench_engine");
  set.add("model", &model_dir, "model folder (make one with: pdserve make-model DIR --preset bench [--fp8])")
      .add("threads", &threads, "compute threads (0: every hardware thread)", 0, 1024)
      .add("isa", &isa_name, "kernel instruction set", {"auto", "avx512", "avx2", "generic"})
      .add("batches", &batches_text, "decode batch sizes, comma-separated")
      .add("context", &context, "cached tokens per sequence during decode", 1, 1 << 20)
      .add("steps", &steps, "timed decode steps per batch size (after 2 warm-up steps)", 1, 10000)
      .add("prefill_tokens", &prefill_tokens, "prompt length of the prefill measurement (0: skip)", 0, 1 << 20)
      .add("bandwidth_mb", &bandwidth_mb, "buffer size of the read-bandwidth probe in MiB", 64, 1 << 20)
      .add("json", &json, "print one JSON object instead of text");
  auto loaded = loadCommandOptions(
      "usage: pdserve bench engine --model DIR [--threads N] [--batches 1,4,16,64] [--json]\n"
      "Decode tokens/s and memory-bandwidth utilization (MBU) per batch size, and prefill tokens/s and FLOP\n"
      "utilization, each as a ratio to a ceiling measured in the same run with the same threads. Use a model whose\n"
      "weights are many times the last-level cache (make-model --preset bench).",
      {&set, &common_sets.log, &common_sets.model}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  auto batches = parsePositiveList(batches_text, "--batches");
  if (!batches.ok()) return reportFailure(batches.error());
  if (model_dir.empty()) {
    auto dir = resolveModelDir(common);
    if (!dir.ok()) return reportFailure(dir.error());
    model_dir = *dir;
  }
  model::CpuEngineOptions eo;
  eo.threads = static_cast<int>(threads);
  if (isa_name == "avx512") eo.isa = model::CpuIsa::Avx512;
  if (isa_name == "avx2") eo.isa = model::CpuIsa::Avx2;
  if (isa_name == "generic") eo.isa = model::CpuIsa::Generic;
  auto engine = model::createCpuEngine(model_dir, eo);
  if (!engine.ok()) return reportFailure(engine.error());
  const model::EngineCapabilities caps = (*engine)->capabilities();
  const model::KernelTable& k = model::kernelTable(eo.isa.value_or(model::detectCpuIsa()));

  double bandwidth = 0.0, peak = 0.0;
  {
    model::ThreadPool pool(caps.threads);
    bandwidth = measureReadBandwidth(pool, k, static_cast<std::size_t>(bandwidth_mb) << 20);
    peak = measurePeakFlops(pool, k);
  }
  if (!json) {
    std::printf("model %s (%s weights), %s, %d threads\n", model_dir.string().c_str(),
                std::string(dtypeName(caps.weight_dtype)).c_str(), caps.backend.c_str(), caps.threads);
    std::printf("ceilings: read bandwidth %.2f GB/s, FMA peak %.1f GFLOP/s\n", bandwidth / 1e9, peak / 1e9);
  }
  std::mt19937 rng(1234);
  std::vector<DecodeResult> decode;
  for (const std::int64_t b : *batches) {
    auto r = benchDecode(**engine, b, context, steps, bandwidth, caps.threads, rng);
    if (!r.ok()) return reportFailure(r.error());
    decode.push_back(*r);
    if (!json) {
      std::printf(
          "decode batch %3lld: %8.2f ms/step  %9.2f tok/s  %8.1f MB/step  %6.2f GB/s  MBU %.3f  (%lld "
          "experts/step, cpu share %.2f)\n",
          static_cast<long long>(b), r->step_seconds * 1e3, static_cast<double>(b) / r->step_seconds,
          r->bytes_per_step / 1e6, r->bytes_per_step / r->step_seconds / 1e9, r->mbu,
          static_cast<long long>(r->experts_per_step), r->cpu_share);
    }
  }
  double prefill_seconds = 0.0, prefill_flops = 0.0, prefill_cpu_share = 0.0;
  if (prefill_tokens > 0) {
    const ModelConfig& cfg = (*engine)->config();
    const std::int64_t blocks = (prefill_tokens + 63) / 64;
    auto cache = model::PagedLatentCache::create(cfg, blocks, 64);
    if (!cache.ok()) return reportFailure(cache.error());
    std::vector<std::int32_t> table(static_cast<std::size_t>(blocks));
    std::iota(table.begin(), table.end(), 0);
    std::uniform_int_distribution<std::int32_t> token(2, static_cast<std::int32_t>(cfg.vocab_size - 1));
    std::vector<std::int32_t> prompt(static_cast<std::size_t>(prefill_tokens));
    for (auto& t : prompt) t = token(rng);
    const model::SequenceChunk chunk{prompt, 0, table};
    model::ForwardOptions o;
    o.attention = model::AttentionPath::Prefill;
    const auto t0 = Clock::now();
    const double c0 = processCpuSeconds();
    auto out = (*engine)->forward(std::span<const model::SequenceChunk>(&chunk, 1), cache->view(), o);
    if (!out.ok()) return reportFailure(out.error());
    prefill_seconds = secondsSince(t0);
    prefill_cpu_share = (processCpuSeconds() - c0) / (prefill_seconds * caps.threads);
    prefill_flops = static_cast<double>(out->stats.flops);
    if (!json) {
      std::printf("prefill %lld tokens: %.3f s  %.1f tok/s  %.1f GFLOP/s  fraction of peak %.3f  (cpu share %.2f)\n",
                  static_cast<long long>(prefill_tokens), prefill_seconds,
                  static_cast<double>(prefill_tokens) / prefill_seconds, prefill_flops / prefill_seconds / 1e9,
                  prefill_flops / prefill_seconds / peak, prefill_cpu_share);
    }
  }
  if (json) {
    std::string d = "[";
    for (std::size_t i = 0; i < decode.size(); ++i) {
      const auto& r = decode[i];
      d += fmt::format(
          "{}{{\"batch\": {}, \"step_ms\": {:.4f}, \"tokens_per_s\": {:.3f}, \"bytes_per_step\": {:.0f}, "
          "\"gbs\": {:.3f}, \"mbu\": {:.4f}, \"experts_per_step\": {}, \"cpu_share\": {:.3f}}}",
          i ? ", " : "", r.batch, r.step_seconds * 1e3, static_cast<double>(r.batch) / r.step_seconds, r.bytes_per_step,
          r.bytes_per_step / r.step_seconds / 1e9, r.mbu, r.experts_per_step, r.cpu_share);
    }
    d += "]";
    double mbu1 = 0.0;
    for (const auto& r : decode) {
      if (r.batch == 1) mbu1 = r.mbu;
    }
    const double prefill_rate = prefill_seconds > 0 ? prefill_flops / prefill_seconds : 0.0;
    std::printf(
        "{\"model\": \"%s\", \"weight_dtype\": \"%s\", \"backend\": \"%s\", \"threads\": %d, "
        "\"read_bandwidth_gbs\": %.3f, \"peak_gflops\": %.2f, \"context\": %lld, \"decode\": %s, "
        "\"mbu_batch1\": %.4f, \"prefill_tokens\": %lld, \"prefill_seconds\": %.4f, "
        "\"prefill_tokens_per_s\": %.2f, \"prefill_gflops\": %.2f, \"prefill_flops_fraction\": %.4f, "
        "\"prefill_cpu_share\": %.3f}\n",
        model_dir.string().c_str(), std::string(dtypeName(caps.weight_dtype)).c_str(), caps.backend.c_str(),
        caps.threads, bandwidth / 1e9, peak / 1e9, static_cast<long long>(context), d.c_str(), mbu1,
        static_cast<long long>(prefill_tokens), prefill_seconds,
        prefill_seconds > 0 ? static_cast<double>(prefill_tokens) / prefill_seconds : 0.0, prefill_rate / 1e9,
        peak > 0 ? prefill_rate / peak : 0.0, prefill_cpu_share);
  }
  return 0;
}

}  // namespace pd::cli
