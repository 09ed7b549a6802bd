// pdserve bench prefill: what KV streaming adds to time to first token (issue 7). For each prompt
// length, in the same run and interleaved, the prefill engine's TTFT (submit to the completion
// record delivered):
//  - compute alone: the KV goes nowhere (the ceiling the other two are compared with);
//  - streaming: each layer's KV is put into a decode process's pool as soon as it is computed
//    (pdserve's way), the record follows the last put;
//  - send-after: the whole prompt is computed first, then every layer is put (the peers' way:
//    vLLM+NIXL, SGLang, TensorRT-LLM, Dynamo).
// streaming_overhead = TTFT(streaming) / TTFT(compute alone) - 1 at 2048 tokens (or the length
// nearest to it). The decode process is this binary in a hidden receiver mode
// (`pdserve bench prefill --receiver --lengths <every transfer's length, in order>`), which expects
// every planned transfer up front and reports arrivals on stdout.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "pd/common/subprocess.h"
#include "pd/common/worker_api.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/engine/model_config.h"
#include "pd/engine/model_hash.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "pd/prefill/prefill_engine.h"
#include "pd/prefill/transport_kv_sink.h"

namespace pd::cli {
namespace {

namespace kvt = pd::kvtransfer;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct BenchPrefillConfig {
  std::filesystem::path model;
  std::string lengths = "512,2048,8192";
  std::int64_t runs = 3;
  std::int64_t threads = 0;
  std::int64_t chunk_size = 512;
  bool json = false;
  bool receiver = false;  // hidden: the decode process
  std::string kv_dtype = "bf16";
};

Result<std::vector<std::int64_t>> parseLengths(const std::string& text) {
  std::vector<std::int64_t> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    std::int64_t v = 0;
    const auto r = std::from_chars(text.data() + pos, text.data() + end, v);
    if (r.ec != std::errc() || r.ptr != text.data() + end || v <= 0) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("--lengths: '{}' is not a positive token count", text.substr(pos, end - pos)));
    }
    out.push_back(v);
    pos = end + 1;
  }
  return out;
}

// ---- the decode process ---------------------------------------------------------------------------

// Expects request i + 1 with lengths[i] tokens for every i, prints "DESCRIPTOR <id> <base64>" for
// each, then "ARRIVED <id> ok|<error>" as records (or failures) arrive, until it is terminated.
// The descriptors share blocks: the pool's contents are not checked, only delivery.
int runReceiver(const BenchPrefillConfig& cfg, const kvt::KvTransferConfig& kv, const std::vector<std::int64_t>& plan) {
  // Before the transport: its callbacks use them until it is gone.
  std::mutex mutex;
  const auto say = [&](const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  auto mcfg = ModelConfig::load(cfg.model);
  if (!mcfg.ok()) return reportFailure(mcfg.error());
  auto hash = pd::modelHash(cfg.model);
  if (!hash.ok()) return reportFailure(hash.error());
  const std::int64_t block_size = 64;
  const std::int64_t max_tokens = *std::max_element(plan.begin(), plan.end());
  const DType dtype = cfg.kv_dtype == "f32" ? DType::F32 : DType::BF16;
  auto pool = decode::KvPool::create(*mcfg, (max_tokens + block_size - 1) / block_size, block_size, dtype);
  if (!pool.ok()) return reportFailure(pool.error());
  auto transport = kvt::createUcxTransport(kvt::ucxOptionsFromConfig(kv, pool->compat(*hash, 1)));
  if (!transport.ok()) return reportFailure(transport.error());
  kvt::Transport& t = **transport;
  auto region = t.registerRegion(pool->memory());
  if (!region.ok()) return reportFailure(region.error());
  const kvt::RegionLayout layout = pool->regionLayout(*region);
  auto target = t.exportTarget(0, std::span(&layout, 1));
  if (!target.ok()) return reportFailure(target.error());
  for (std::size_t i = 0; i < plan.size(); ++i) {
    kvt::KvDescriptor d;
    d.request_id = i + 1;
    d.compat = pool->compat(*hash, 1);
    d.num_tokens = static_cast<std::uint32_t>(plan[i]);
    d.timeout_ms = 3600 * 1000;
    for (std::int64_t b = 0; b < (plan[i] + block_size - 1) / block_size; ++b) {
      d.block_ids.push_back(static_cast<std::uint32_t>(b));
    }
    d.targets.push_back(*target);
    const Status s =
        t.expect(d.request_id, Clock::now() + 3600s, [&](std::uint64_t id, Result<kvt::CompletionRecord> r) {
          std::lock_guard lock(mutex);
          say(fmt::format("ARRIVED {} {}", id, r.ok() ? std::string("ok") : r.error().toString()));
        });
    if (!s.ok()) return reportFailure(s.error());
    const std::vector<std::uint8_t> bytes = kvt::encode(d);
    std::lock_guard lock(mutex);
    say(fmt::format(
        "DESCRIPTOR {} {}", d.request_id,
        worker_api::base64Encode(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()))));
  }
  // Stays up until the bench ends it (SIGTERM): the sender's last flush follows its record, and a
  // receiver gone by then would fail that transfer.
  for (;;) ::pause();
}

// ---- the prefill side -----------------------------------------------------------------------------

// Where the KV of "compute alone" goes: nowhere; the outcome is reported at once.
class DiscardSink final : public prefill::KvSink {
 public:
  explicit DiscardSink(std::promise<Status> done) : done_(std::move(done)) {}
  Status putLayer(std::uint32_t, std::int64_t, std::span<const float>) override { return okStatus(); }
  void complete(kvt::CompletionRecord) override { done_.set_value(okStatus()); }
  void fail(const Error& reason) override { done_.set_value(reason); }

 private:
  std::promise<Status> done_;
};

// Send-after: keeps every layer until the prompt is done, then puts them all and finishes.
class SendAfterSink final : public prefill::KvSink {
 public:
  explicit SendAfterSink(std::unique_ptr<prefill::KvSink> inner) : inner_(std::move(inner)) {}
  Status putLayer(std::uint32_t layer, std::int64_t first_pos, std::span<const float> rows) override {
    held_.push_back(Held{layer, first_pos, {rows.begin(), rows.end()}});
    return okStatus();
  }
  void complete(kvt::CompletionRecord record) override {
    for (const Held& h : held_) {
      if (Status s = inner_->putLayer(h.layer, h.first_pos, h.rows); !s.ok()) return inner_->fail(s.error());
    }
    inner_->complete(std::move(record));
  }
  void fail(const Error& reason) override { inner_->fail(reason); }

 private:
  struct Held {
    std::uint32_t layer;
    std::int64_t first_pos;
    std::vector<float> rows;
  };
  std::unique_ptr<prefill::KvSink> inner_;
  std::vector<Held> held_;
};

enum class Mode { Compute, Streaming, SendAfter };

class Bench {
 public:
  Bench(model::Engine& engine, prefill::PrefillEngine& prefill, proc::Subprocess& receiver,
        const kvt::KvTransferConfig& kv)
      : engine_(engine), prefill_(prefill), lines_(receiver.stdoutFd()), kv_(kv) {}

  /// Reads the receiver's descriptors (one per planned transfer).
  Status readDescriptors(std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      const auto line = lines_.next(120s);
      const std::string prefix = fmt::format("DESCRIPTOR {} ", i + 1);
      if (!line || line->rfind(prefix, 0) != 0) {
        return makeError(ErrorCode::PeerFailed, fmt::format("receiver: {}", line.value_or("no descriptor")));
      }
      PD_ASSIGN_OR_RETURN(std::string bytes, worker_api::base64Decode(line->substr(prefix.size())));
      PD_ASSIGN_OR_RETURN(kvt::KvDescriptor d, kvt::decodeKvDescriptor(std::span(
                                                   reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size())));
      descriptors_.push_back(std::move(d));
    }
    return okStatus();
  }

  // TTFT in seconds of one prompt of `tokens` tokens.
  Result<double> run(Mode mode, std::int64_t tokens) {
    const std::uint64_t id = next_id_++;
    std::vector<std::int32_t> prompt(static_cast<std::size_t>(tokens));
    std::mt19937 rng(static_cast<std::uint32_t>(id));
    for (auto& t : prompt) t = static_cast<std::int32_t>(2 + rng() % (engine_.config().vocab_size - 2));
    std::promise<Status> done;
    std::future<Status> outcome = done.get_future();
    prefill::PrefillRequest r;
    r.id = id;
    r.tokens = std::move(prompt);
    Clock::time_point t0;
    if (mode == Mode::Compute) {
      r.sink = std::make_unique<DiscardSink>(std::move(done));
      t0 = Clock::now();
    } else {
      // The receiver expected the request already (the decode worker's admission, not timed).
      if (next_transfer_ >= descriptors_.size() || descriptors_[next_transfer_].num_tokens != tokens) {
        return makeError(ErrorCode::Internal, "bench: transfers out of plan");
      }
      const kvt::KvDescriptor& d = descriptors_[next_transfer_++];
      PD_ASSIGN_OR_RETURN(kvt::Transport * t, transport(d.compat));
      auto shared = std::make_shared<std::promise<Status>>(std::move(done));
      t0 = Clock::now();
      PD_ASSIGN_OR_RETURN(
          auto sink, prefill::TransportKvSink::create(*t, d, Clock::now() + 600s, [shared](std::uint64_t, Status s) {
            shared->set_value(std::move(s));
          }));
      if (mode == Mode::SendAfter) {
        r.sink = std::make_unique<SendAfterSink>(std::move(sink));
      } else {
        r.sink = std::move(sink);
      }
    }
    PD_TRY(prefill_.submit(std::move(r)));
    const Status s = outcome.get();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    PD_TRY(s);
    if (mode != Mode::Compute) {
      const auto arrived = lines_.next(60s);
      if (!arrived || *arrived != fmt::format("ARRIVED {} ok", next_transfer_)) {
        return makeError(ErrorCode::PeerFailed, fmt::format("receiver: {}", arrived.value_or("no answer")));
      }
    }
    return seconds;
  }

 private:
  Result<kvt::Transport*> transport(const kvt::CompatInfo& compat) {
    if (!transport_) {
      kvt::UcxTransportOptions o = kvt::ucxOptionsFromConfig(kv_, compat);
      o.name = "bench-prefill";
      PD_ASSIGN_OR_RETURN(transport_, kvt::createUcxTransport(o));
    }
    return transport_.get();
  }

  model::Engine& engine_;
  prefill::PrefillEngine& prefill_;
  proc::LineReader lines_;
  const kvt::KvTransferConfig& kv_;
  std::unique_ptr<kvt::Transport> transport_;
  std::vector<kvt::KvDescriptor> descriptors_;
  std::size_t next_transfer_ = 0;
  std::uint64_t next_id_ = 1;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int runBenchPrefill(const std::vector<std::string>& args) {
  BenchPrefillConfig cfg;
  CommonConfig common;
  CommonOptions common_sets(common);
  kvt::KvTransferConfig kv;
  config::OptionSet set("bench_prefill");
  config::OptionSet kv_set("kvtransfer");
  kvt::registerOptions(kv_set, kv);
  set.add("model", &cfg.model, "model folder; empty: model.path, or the embedded default model")
      .add("lengths", &cfg.lengths, "comma-separated prompt lengths in tokens")
      .add("runs", &cfg.runs, "runs per length and mode (the median is reported)", 1, 1000)
      .add("threads", &cfg.threads, "compute threads (0: every hardware thread)", 0, 1024)
      .add("chunk_size", &cfg.chunk_size, "prefill chunk size", 1, 1 << 20)
      .add("kv_dtype", &cfg.kv_dtype, "the decode pool's KV dtype", {"bf16", "f32"})
      .add("json", &cfg.json, "print one JSON object instead of the table")
      .add("receiver", &cfg.receiver, "internal: run as the decode process");
  auto loaded = loadCommandOptions(
      "usage: pdserve bench prefill [--model DIR] [--lengths 512,2048,8192] [--runs 3] [--json]\n"
      "TTFT of the prefill engine: compute alone, compute + layer-wise streaming to a decode process, and\n"
      "compute then send-after, interleaved in one run. streaming_overhead = streaming / compute alone - 1 at\n"
      "2048 tokens (or the nearest length).",
      {&set, &kv_set, &common_sets.log, &common_sets.model}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  auto lengths = parseLengths(cfg.lengths);
  if (!lengths.ok()) return reportFailure(lengths.error());
  const std::int64_t max_len = *std::max_element(lengths->begin(), lengths->end());
  if (cfg.model.empty()) {
    auto dir = resolveModelDir(common);
    if (!dir.ok()) return reportFailure(dir.error());
    cfg.model = *dir;
  }
  if (cfg.receiver) return runReceiver(cfg, kv, *lengths);

  model::CpuEngineOptions eo;
  eo.threads = static_cast<int>(cfg.threads);
  auto engine = model::createCpuEngine(cfg.model, eo);
  if (!engine.ok()) return reportFailure(engine.error());
  prefill::PrefillEngineOptions po;
  po.chunk_size = cfg.chunk_size;
  po.token_budget = std::max<std::int64_t>(cfg.chunk_size, 2048);
  po.block_size = 64;
  po.cache_blocks = (max_len + 63) / 64;
  auto prefill = prefill::PrefillEngine::create(**engine, po);
  if (!prefill.ok()) return reportFailure(prefill.error());
  (*prefill)->start();

  // The plan: a warm-up of each mode (page faults, the UCX connection; not counted), then every
  // length `runs` times, the modes interleaved so that drift of the machine hits them alike.
  const std::vector<Mode> modes{Mode::Compute, Mode::Streaming, Mode::SendAfter};
  std::vector<std::pair<Mode, std::int64_t>> plan;
  for (const Mode m : modes) plan.emplace_back(m, std::min<std::int64_t>(64, max_len));
  for (const std::int64_t n : *lengths) {
    for (std::int64_t i = 0; i < cfg.runs; ++i) {
      for (const Mode m : modes) plan.emplace_back(m, n);
    }
  }
  std::string transfers;  // the receiver's plan: every transfer's length, in order
  std::size_t transfer_count = 0;
  for (const auto& [m, n] : plan) {
    if (m == Mode::Compute) continue;
    transfers += (transfers.empty() ? "" : ",") + std::to_string(n);
    ++transfer_count;
  }
  auto self = proc::selfExecutable();
  if (!self.ok()) return reportFailure(self.error());
  proc::SpawnOptions so;
  so.argv = {*self,
             "bench",
             "prefill",
             "--receiver",
             "--model",
             cfg.model.string(),
             "--lengths",
             transfers,
             "--kv-dtype",
             cfg.kv_dtype,
             "--kvtransfer.ucx_tls",
             kv.ucx_tls,
             "--kvtransfer.data_path",
             kv.data_path,
             "--log.level",
             "warn"};
  so.capture_stderr = false;
  auto receiver = proc::Subprocess::spawn(so);
  if (!receiver.ok()) return reportFailure(receiver.error());
  Bench bench(**engine, **prefill, **receiver, kv);
  if (Status s = bench.readDescriptors(transfer_count); !s.ok()) return reportFailure(s.error());

  struct Row {
    std::int64_t tokens = 0;
    std::vector<double> compute, streaming, send_after;
  };
  std::vector<Row> rows;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const auto [mode, n] = plan[i];
    auto t = bench.run(mode, n);
    if (!t.ok()) return reportFailure(t.error());
    if (i < modes.size()) continue;  // warm-up
    if (rows.empty() || rows.back().tokens != n) rows.push_back(Row{n, {}, {}, {}});
    Row& row = rows.back();
    (mode == Mode::Compute ? row.compute : mode == Mode::Streaming ? row.streaming : row.send_after).push_back(*t);
  }
  (*receiver)->signal(SIGTERM);
  (void)(*receiver)->wait(10s);

  // The headline length: 2048, or the nearest one measured.
  const Row* headline = &rows.front();
  for (const Row& r : rows) {
    if (std::abs(r.tokens - 2048) < std::abs(headline->tokens - 2048)) headline = &r;
  }
  const auto overhead = [](const std::vector<double>& a, const std::vector<double>& base) {
    return median(a) / median(base) - 1.0;
  };
  if (cfg.json) {
    boost::json::array cases;
    for (const Row& r : rows) {
      boost::json::object o;
      o["tokens"] = r.tokens;
      o["compute_ttft_s"] = median(r.compute);
      o["streaming_ttft_s"] = median(r.streaming);
      o["send_after_ttft_s"] = median(r.send_after);
      o["streaming_overhead"] = overhead(r.streaming, r.compute);
      o["send_after_overhead"] = overhead(r.send_after, r.compute);
      cases.push_back(std::move(o));
    }
    boost::json::object out;
    out["model"] = cfg.model.string();
    out["threads"] = (*engine)->capabilities().threads;
    out["runs"] = cfg.runs;
    out["kv_dtype"] = cfg.kv_dtype;
    out["ucx_tls"] = kv.ucx_tls;
    out["cases"] = std::move(cases);
    out["headline_tokens"] = headline->tokens;
    out["streaming_overhead"] = overhead(headline->streaming, headline->compute);
    out["send_after_overhead"] = overhead(headline->send_after, headline->compute);
    out["streaming_vs_send_after"] = median(headline->streaming) / median(headline->send_after);
    std::printf("%s\n", boost::json::serialize(out).c_str());
  } else {
    std::printf("%8s %14s %14s %14s %10s %10s\n", "tokens", "compute s", "streaming s", "send-after s", "stream +%",
                "after +%");
    for (const Row& r : rows) {
      std::printf("%8lld %14.4f %14.4f %14.4f %9.1f%% %9.1f%%\n", static_cast<long long>(r.tokens), median(r.compute),
                  median(r.streaming), median(r.send_after), 100 * overhead(r.streaming, r.compute),
                  100 * overhead(r.send_after, r.compute));
    }
    std::printf("streaming_overhead (%lld tokens): %.3f\n", static_cast<long long>(headline->tokens),
                overhead(headline->streaming, headline->compute));
  }
  return 0;
}

}  // namespace pd::cli
