// The CPU engine benchmark: decode MBU and prefill FLOP utilization (engine_bench.h).
#include "bench/engine/engine_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/common/bench_util.h"
#include "pd/common/dtype.h"
#include "pd/engine/engine.h"
#include "pd/engine/kernels.h"
#include "pd/engine/thread_pool.h"

namespace pd::bench {
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

Result<EngineDecodeRow> benchDecode(model::Engine& engine, std::int64_t batch, std::int64_t context, std::int64_t steps,
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
  EngineDecodeRow r;
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
  r.step_seconds = medianSeconds(times);
  r.experts_per_step /= steps;
  r.mbu = memoryBandwidthUtilization(r.bytes_per_step, r.step_seconds, bandwidth);
  return r;
}

}  // namespace

double memoryBandwidthUtilization(double bytes_per_step, double step_seconds, double bandwidth) {
  if (!(step_seconds > 0) || !(bandwidth > 0)) return 0.0;
  return bytes_per_step / step_seconds / bandwidth;
}

double medianSeconds(std::vector<double> seconds) {
  if (seconds.empty()) return 0.0;
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

double batchOneMbu(const EngineBenchResult& result) {
  for (const auto& r : result.decode) {
    if (r.batch == 1) return r.mbu;
  }
  return 0.0;
}

double prefillFlopsFraction(const EngineBenchResult& result) {
  if (!(result.prefill_seconds > 0) || !(result.peak_flops > 0)) return 0.0;
  return result.prefill_flops / result.prefill_seconds / result.peak_flops;
}

Result<EngineBenchResult> runEngineBench(const EngineBenchConfig& cfg) {
  model::CpuEngineOptions eo;
  eo.threads = static_cast<int>(cfg.threads);
  eo.isa = cfg.isa;
  eo.batch_invariant = cfg.batch_invariant;
  PD_ASSIGN_OR_RETURN(auto engine, model::createCpuEngine(cfg.model, eo));
  const model::EngineCapabilities caps = engine->capabilities();
  const model::KernelTable& k = model::kernelTable(eo.isa.value_or(model::detectCpuIsa()));

  EngineBenchResult result;
  result.model = cfg.model.string();
  result.weight_dtype = std::string(dtypeName(caps.weight_dtype));
  result.backend = caps.backend;
  result.batch_invariant = cfg.batch_invariant;
  result.threads = caps.threads;
  result.context = cfg.context;
  {
    model::ThreadPool pool(caps.threads);
    result.read_bandwidth = measureReadBandwidth(pool, k, static_cast<std::size_t>(cfg.bandwidth_mb) << 20);
    result.peak_flops = measurePeakFlops(pool, k);
  }
  std::mt19937 rng(1234);  // NOLINT(bugprone-random-generator-seed): the same tokens in every run
  for (const std::int64_t b : cfg.batches) {
    PD_ASSIGN_OR_RETURN(EngineDecodeRow row,
                        benchDecode(*engine, b, cfg.context, cfg.steps, result.read_bandwidth, caps.threads, rng));
    result.decode.push_back(row);
  }
  if (cfg.prefill_tokens > 0) {
    const ModelConfig& mc = engine->config();
    const std::int64_t blocks = (cfg.prefill_tokens + 63) / 64;
    PD_ASSIGN_OR_RETURN(auto cache, model::PagedLatentCache::create(mc, blocks, 64));
    std::vector<std::int32_t> table(static_cast<std::size_t>(blocks));
    std::iota(table.begin(), table.end(), 0);
    std::uniform_int_distribution<std::int32_t> token(2, static_cast<std::int32_t>(mc.vocab_size - 1));
    std::vector<std::int32_t> prompt(static_cast<std::size_t>(cfg.prefill_tokens));
    for (auto& t : prompt) t = token(rng);
    const model::SequenceChunk chunk{prompt, 0, table};
    model::ForwardOptions o;
    o.attention = model::AttentionPath::Prefill;
    const auto t0 = Clock::now();
    const double c0 = processCpuSeconds();
    PD_ASSIGN_OR_RETURN(auto out, engine->forward(std::span<const model::SequenceChunk>(&chunk, 1), cache.view(), o));
    result.prefill_tokens = cfg.prefill_tokens;
    result.prefill_seconds = secondsSince(t0);
    result.prefill_cpu_share = (processCpuSeconds() - c0) / (result.prefill_seconds * caps.threads);
    result.prefill_flops = static_cast<double>(out.stats.flops);
  }
  return result;
}

std::string engineReportText(const EngineBenchResult& r) {
  std::string out = fmt::format("model {} ({} weights), {}{}, {} threads\n", r.model, r.weight_dtype, r.backend,
                                r.batch_invariant ? " batch-invariant" : "", r.threads);
  out += fmt::format("ceilings: read bandwidth {:.2f} GB/s, FMA peak {:.1f} GFLOP/s\n", r.read_bandwidth / 1e9,
                     r.peak_flops / 1e9);
  for (const auto& d : r.decode) {
    out += fmt::format(
        "decode batch {:3}: {:8.2f} ms/step  {:9.2f} tok/s  {:8.1f} MB/step  {:6.2f} GB/s  MBU {:.3f}  ({} "
        "experts/step, cpu share {:.2f})\n",
        d.batch, d.step_seconds * 1e3, static_cast<double>(d.batch) / d.step_seconds, d.bytes_per_step / 1e6,
        d.bytes_per_step / d.step_seconds / 1e9, d.mbu, d.experts_per_step, d.cpu_share);
  }
  if (r.prefill_tokens > 0) {
    out += fmt::format(
        "prefill {} tokens: {:.3f} s  {:.1f} tok/s  {:.1f} GFLOP/s  fraction of peak {:.3f}  (cpu share {:.2f})\n",
        r.prefill_tokens, r.prefill_seconds, static_cast<double>(r.prefill_tokens) / r.prefill_seconds,
        r.prefill_flops / r.prefill_seconds / 1e9, prefillFlopsFraction(r), r.prefill_cpu_share);
  }
  return out;
}

std::string engineReportJson(const EngineBenchResult& r) {
  std::string d = "[";
  for (std::size_t i = 0; i < r.decode.size(); ++i) {
    const auto& x = r.decode[i];
    d += fmt::format(
        "{}{{\"batch\": {}, \"step_ms\": {:.4f}, \"tokens_per_s\": {:.3f}, \"bytes_per_step\": {:.0f}, "
        "\"gbs\": {:.3f}, \"mbu\": {:.4f}, \"experts_per_step\": {}, \"cpu_share\": {:.3f}}}",
        i ? ", " : "", x.batch, x.step_seconds * 1e3, static_cast<double>(x.batch) / x.step_seconds, x.bytes_per_step,
        x.bytes_per_step / x.step_seconds / 1e9, x.mbu, x.experts_per_step, x.cpu_share);
  }
  d += "]";
  const double prefill_rate = r.prefill_seconds > 0 ? r.prefill_flops / r.prefill_seconds : 0.0;
  return fmt::format(
      "{{\"model\": \"{}\", \"weight_dtype\": \"{}\", \"backend\": \"{}\", \"batch_invariant\": {}, \"threads\": {}, "
      "\"read_bandwidth_gbs\": {:.3f}, \"peak_gflops\": {:.2f}, \"context\": {}, \"decode\": {}, "
      "\"mbu_batch1\": {:.4f}, \"prefill_tokens\": {}, \"prefill_seconds\": {:.4f}, "
      "\"prefill_tokens_per_s\": {:.2f}, \"prefill_gflops\": {:.2f}, \"prefill_flops_fraction\": {:.4f}, "
      "\"prefill_cpu_share\": {:.3f}}}",
      r.model, r.weight_dtype, r.backend, r.batch_invariant, r.threads, r.read_bandwidth / 1e9, r.peak_flops / 1e9,
      r.context, d, batchOneMbu(r), r.prefill_tokens, r.prefill_seconds,
      r.prefill_seconds > 0 ? static_cast<double>(r.prefill_tokens) / r.prefill_seconds : 0.0, prefill_rate / 1e9,
      prefillFlopsFraction(r), r.prefill_cpu_share);
}

}  // namespace pd::bench
