// The prefill TTFT benchmark: compute alone vs streaming vs send-after (prefill_bench.h).
#include "bench/prefill/prefill_bench.h"

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

#include "bench/common/bench_util.h"
#include "pd/common/check.h"
#include "pd/common/kv_format.h"
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

namespace pd::bench {
namespace {

namespace kvt = pd::kvtransfer;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// ---- the decode process ---------------------------------------------------------------------------

// Expects request i + 1 with lengths[i] tokens for every i, prints "DESCRIPTOR <id> <base64>" for
// each, then "ARRIVED <id> ok|<error>" as records (or failures) arrive, until it is terminated.
// The descriptors share blocks: the pool's contents are not checked, only delivery.
Status receive(const std::filesystem::path& model, const kvt::KvTransferConfig& kv, const std::string& kv_dtype,
               const std::vector<std::int64_t>& plan) {
  // Before the transport: its callbacks use them until it is gone.
  std::mutex mutex;
  const auto say = [&](const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  PD_ASSIGN_OR_RETURN(const ModelConfig mcfg, ModelConfig::load(model));
  PD_ASSIGN_OR_RETURN(const std::uint64_t hash, pd::modelHash(model));
  const std::int64_t block_size = 64;
  const std::int64_t max_tokens = *std::max_element(plan.begin(), plan.end());
  const DType dtype = parseKvDType(kv_dtype).value_or(DType::BF16);
  PD_ASSIGN_OR_RETURN(auto pool,
                      decode::KvPool::create(mcfg, (max_tokens + block_size - 1) / block_size, block_size, dtype));
  PD_ASSIGN_OR_RETURN(auto transport, kvt::createUcxTransport(kvt::ucxOptionsFromConfig(kv, pool.compat(hash, 1))));
  kvt::Transport& t = *transport;
  PD_ASSIGN_OR_RETURN(auto region, t.registerRegion(pool.memory()));
  const kvt::RegionLayout layout = pool.regionLayout(region);
  PD_ASSIGN_OR_RETURN(auto target, t.exportTarget(0, std::span(&layout, 1)));
  for (std::size_t i = 0; i < plan.size(); ++i) {
    kvt::KvDescriptor d;
    const std::uint64_t request = i + 1;
    d.compat = pool.compat(hash, 1);
    d.num_tokens = static_cast<std::uint32_t>(plan[i]);
    d.timeout_ms = 3600 * 1000;
    for (std::int64_t b = 0; b < (plan[i] + block_size - 1) / block_size; ++b) {
      d.block_ids.push_back(static_cast<std::uint32_t>(b));
    }
    d.targets.push_back(target);
    const Status s =
        t.expect(request, Clock::now() + 3600s, [&](std::uint64_t id, const Result<kvt::CompletionRecord>& r) {
          std::lock_guard lock(mutex);
          say(fmt::format("ARRIVED {} {}", id, r.ok() ? std::string("ok") : r.error().toString()));
        });
    PD_TRY(s);
    PD_ASSIGN_OR_RETURN(d, t.grant(request, std::move(d)));
    const std::vector<std::uint8_t> bytes = kvt::encode(d);
    std::lock_guard lock(mutex);
    say(fmt::format(
        "DESCRIPTOR {} {}", request,
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
      PD_ASSIGN_OR_RETURN(auto sink, prefill::TransportKvSink::create(*t, d, Clock::now() + 600s,
                                                                      [shared](const kvt::TransferId&, Status s) {
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

}  // namespace

Result<std::vector<std::int64_t>> parsePrefillLengths(const std::string& text) {
  auto lengths = positiveIntegers(text);
  if (!lengths.ok()) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("--lengths: '{}' is not a positive token count", lengths.error().message));
  }
  return lengths;
}

Result<std::vector<std::int64_t>> fitPrefillLengths(const std::vector<std::int64_t>& requested, std::int64_t context) {
  if (!requested.empty()) {
    for (const std::int64_t n : requested) {
      if (context > 0 && n > context) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("--lengths: {} tokens exceed the model's context of {} tokens", n, context));
      }
    }
    return requested;
  }
  std::vector<std::int64_t> out;
  bool cut = false;
  for (const std::int64_t n : kPrefillDefaultLengths) {
    if (context > 0 && n > context) {
      cut = true;
    } else {
      out.push_back(n);
    }
  }
  if (cut && (out.empty() || out.back() != context)) out.push_back(context);
  return out;
}

double medianOf(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

double overheadRatio(const std::vector<double>& ttft, const std::vector<double>& ceiling) {
  return medianOf(ttft) / medianOf(ceiling) - 1.0;
}

const PrefillRow& headlineRow(const std::vector<PrefillRow>& rows) {
  PD_CHECK(!rows.empty());
  const PrefillRow* best = &rows.front();
  for (const PrefillRow& r : rows) {
    if (std::abs(r.tokens - kPrefillHeadlineTokens) < std::abs(best->tokens - kPrefillHeadlineTokens)) best = &r;
  }
  return *best;
}

Status runPrefillReceiver(const std::filesystem::path& model, const kvtransfer::KvTransferConfig& kv,
                          const std::string& kv_dtype, const std::vector<std::int64_t>& plan) {
  if (plan.empty()) return makeError(ErrorCode::InvalidArgument, "receiver: no transfers planned");
  return receive(model, kv, kv_dtype, plan);
}

Result<PrefillBenchResult> runPrefillBench(const PrefillBenchConfig& cfg) {
  if (cfg.lengths.empty()) return makeError(ErrorCode::InvalidArgument, "bench prefill: no lengths");
  const std::int64_t max_len = *std::max_element(cfg.lengths.begin(), cfg.lengths.end());
  model::CpuEngineOptions eo;
  eo.threads = static_cast<int>(cfg.threads);
  eo.batch_invariant = cfg.batch_invariant;
  PD_ASSIGN_OR_RETURN(auto engine, model::createCpuEngine(cfg.model, eo));
  prefill::PrefillEngineOptions po;
  po.chunk_size = cfg.chunk_size;
  po.token_budget = std::max<std::int64_t>(cfg.chunk_size, 2048);
  po.block_size = 64;
  po.cache_blocks = (max_len + 63) / 64;
  PD_ASSIGN_OR_RETURN(auto prefill, prefill::PrefillEngine::create(*engine, po));
  prefill->start();

  // The plan: a warm-up of each mode (page faults, the UCX connection; not counted), then every
  // length `runs` times, the modes interleaved so that drift of the machine hits them alike.
  const std::vector<Mode> modes{Mode::Compute, Mode::Streaming, Mode::SendAfter};
  std::vector<std::pair<Mode, std::int64_t>> plan;
  plan.reserve(modes.size() * (1 + cfg.lengths.size() * static_cast<std::size_t>(std::max<std::int64_t>(cfg.runs, 0))));
  for (const Mode m : modes) plan.emplace_back(m, std::min<std::int64_t>(64, max_len));
  for (const std::int64_t n : cfg.lengths) {
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
  proc::SpawnOptions so;
  so.argv = cfg.receiver_argv;
  so.argv.insert(so.argv.end(), {"--lengths", transfers});
  so.capture_stderr = false;
  PD_ASSIGN_OR_RETURN(auto receiver, proc::Subprocess::spawn(so));
  Bench bench(*engine, *prefill, *receiver, cfg.kvtransfer);
  PD_TRY(bench.readDescriptors(transfer_count));

  PrefillBenchResult result;
  result.threads = engine->capabilities().threads;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const auto [mode, n] = plan[i];
    PD_ASSIGN_OR_RETURN(const double t, bench.run(mode, n));
    if (i < modes.size()) continue;  // warm-up
    if (result.rows.empty() || result.rows.back().tokens != n) result.rows.push_back(PrefillRow{n, {}, {}, {}});
    PrefillRow& row = result.rows.back();
    (mode == Mode::Compute ? row.compute : mode == Mode::Streaming ? row.streaming : row.send_after).push_back(t);
  }
  receiver->signal(SIGTERM);
  (void)receiver->wait(10s);
  return result;
}

std::string prefillReportJson(const PrefillBenchConfig& cfg, const PrefillBenchResult& result) {
  boost::json::array cases;
  for (const PrefillRow& r : result.rows) {
    boost::json::object o;
    o["tokens"] = r.tokens;
    o["compute_ttft_s"] = medianOf(r.compute);
    o["streaming_ttft_s"] = medianOf(r.streaming);
    o["send_after_ttft_s"] = medianOf(r.send_after);
    o["streaming_overhead"] = overheadRatio(r.streaming, r.compute);
    o["send_after_overhead"] = overheadRatio(r.send_after, r.compute);
    cases.push_back(std::move(o));
  }
  const PrefillRow& headline = headlineRow(result.rows);
  boost::json::object out;
  out["model"] = cfg.model.string();
  out["threads"] = result.threads;
  out["runs"] = cfg.runs;
  out["kv_dtype"] = cfg.kv_dtype;
  out["ucx_tls"] = cfg.kvtransfer.ucx_tls;
  out["cases"] = std::move(cases);
  out["headline_tokens"] = headline.tokens;
  out["streaming_overhead"] = overheadRatio(headline.streaming, headline.compute);
  out["send_after_overhead"] = overheadRatio(headline.send_after, headline.compute);
  out["streaming_vs_send_after"] = medianOf(headline.streaming) / medianOf(headline.send_after);
  return boost::json::serialize(out);
}

std::string prefillReportTable(const PrefillBenchResult& result) {
  std::string out = fmt::format("{:>8} {:>14} {:>14} {:>14} {:>10} {:>10}\n", "tokens", "compute s", "streaming s",
                                "send-after s", "stream +%", "after +%");
  for (const PrefillRow& r : result.rows) {
    out += fmt::format("{:8} {:14.4f} {:14.4f} {:14.4f} {:9.1f}% {:9.1f}%\n", r.tokens, medianOf(r.compute),
                       medianOf(r.streaming), medianOf(r.send_after), 100 * overheadRatio(r.streaming, r.compute),
                       100 * overheadRatio(r.send_after, r.compute));
  }
  const PrefillRow& headline = headlineRow(result.rows);
  out += fmt::format("streaming_overhead ({} tokens): {:.3f}\n", headline.tokens,
                     overheadRatio(headline.streaming, headline.compute));
  return out;
}

}  // namespace pd::bench
