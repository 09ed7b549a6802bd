// The KV transfer benchmark against ucx_perftest (kv_bench.h).
#include "bench/kv/kv_bench.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench/common/bench_util.h"
#include "pd/common/log.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/ucx_transport.h"

namespace pd::bench {
namespace {

using kvtransfer::Clock;
using namespace std::chrono_literals;

// ---- small pieces ---------------------------------------------------------------------------

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// The 8 bytes at `word` of token `token` of layer `layer` in the benchmark's payload.
std::uint64_t patternWord(std::uint32_t layer, std::uint32_t token, std::uint64_t word) {
  return mix((std::uint64_t{layer} << 48) ^ (std::uint64_t{token} << 24) ^ word);
}

/// Length-prefixed frames over the control socket between the two benchmark processes.
bool writeFrame(int fd, std::string_view payload) {
  const auto n = static_cast<std::uint32_t>(payload.size());
  std::string frame(sizeof(n) + payload.size(), '\0');
  std::memcpy(frame.data(), &n, sizeof(n));
  std::memcpy(frame.data() + sizeof(n), payload.data(), payload.size());
  std::size_t done = 0;
  while (done < frame.size()) {
    const ssize_t w = ::write(fd, frame.data() + done, frame.size() - done);
    if (w <= 0) return false;
    done += static_cast<std::size_t>(w);
  }
  return true;
}

std::optional<std::string> readFrame(int fd, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string buffer;
  std::optional<std::uint32_t> need;
  while (true) {
    if (!need && buffer.size() >= 4) {
      std::uint32_t n = 0;
      std::memcpy(&n, buffer.data(), 4);
      need = n;
    }
    if (need && buffer.size() >= 4 + *need) return buffer.substr(4, *need);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return std::nullopt;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left)) <= 0) continue;
    // Read no further than this frame: the next one stays in the socket.
    char chunk[4096];
    const std::size_t want = need ? 4 + *need - buffer.size() : 4 - buffer.size();
    const ssize_t r = ::read(fd, chunk, std::min(sizeof(chunk), want));
    if (r <= 0) return std::nullopt;
    buffer.append(chunk, static_cast<std::size_t>(r));
  }
}

/// Waits for one transport callback.
template <class T>
class OneShot {
 public:
  void set(T value) {
    std::lock_guard lock(mutex_);
    value_.emplace(std::move(value));
    cv_.notify_all();
  }
  std::optional<T> wait(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, timeout, [&] { return value_.has_value(); });
    auto out = std::move(value_);
    value_.reset();
    return out;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::optional<T> value_;
};

// ---- the decode side (child process) --------------------------------------------------------

int runReceiver(int control, const kvtransfer::UcxTransportOptions& options, std::uint32_t max_tokens) {
  const auto& c = options.compat;
  auto transport = kvtransfer::createUcxTransport(options);
  if (!transport.ok()) {
    (void)writeFrame(control, "error " + transport.error().toString());
    return 1;
  }
  auto& t = *transport.value();
  const std::uint32_t num_blocks = (max_tokens + c.block_size - 1) / c.block_size;
  const std::uint64_t block_bytes = std::uint64_t{c.block_size} * c.tokenBytes();
  std::vector<std::byte> pool(block_bytes * num_blocks * c.num_layers);
  auto region = t.registerRegion(pool);
  if (!region.ok()) {
    (void)writeFrame(control, "error " + region.error().toString());
    return 1;
  }
  const kvtransfer::RegionLayout layout{region.value(), 0, 0, c.num_layers, block_bytes * num_blocks, block_bytes};
  auto target = t.exportTarget(0, std::span(&layout, 1));
  if (!target.ok()) {
    (void)writeFrame(control, "error " + target.error().toString());
    return 1;
  }
  OneShot<Result<kvtransfer::CompletionRecord>> arrival;
  while (true) {
    const auto command = readFrame(control, std::chrono::hours(1));
    if (!command || *command == "quit") break;
    // "go <request id> <tokens> <verify 0|1>"
    std::uint64_t id = 0;
    std::uint32_t tokens = 0;
    int verify = 0;
    std::istringstream words(*command);
    std::string verb;
    if (!(words >> verb >> id >> tokens >> verify) || verb != "go") break;
    kvtransfer::KvDescriptor d;
    d.compat = c;
    d.num_tokens = tokens;
    d.timeout_ms = 60000;
    d.block_ids.resize(num_blocks);
    std::iota(d.block_ids.begin(), d.block_ids.end(), 0U);
    std::mt19937_64 rng(id);
    std::shuffle(d.block_ids.begin(), d.block_ids.end(), rng);
    d.block_ids.resize((tokens + c.block_size - 1) / c.block_size);
    d.targets = {target.value()};
    if (verify != 0) std::fill(pool.begin(), pool.end(), std::byte{0});
    const Status expected =
        t.expect(id, Clock::now() + 120s,
                 [&](std::uint64_t, Result<kvtransfer::CompletionRecord> r) { arrival.set(std::move(r)); });
    if (!expected.ok()) {
      (void)writeFrame(control, "error " + expected.error().toString());
      return 1;
    }
    auto granted = t.grant(id, std::move(d));
    if (!granted.ok()) {
      (void)writeFrame(control, "error " + granted.error().toString());
      return 1;
    }
    const auto wire = kvtransfer::encode(*granted);
    if (!writeFrame(control, std::string_view(reinterpret_cast<const char*>(wire.data()), wire.size()))) break;
    auto got = arrival.wait(130s);
    std::string result = "ok";
    if (!got || !got->ok()) {
      result = "error " + (got ? got->error().toString() : std::string("no callback"));
    } else if (verify != 0) {
      for (std::uint32_t l = 0; l < c.num_layers && result == "ok"; ++l) {
        for (std::uint32_t tok = 0; tok < tokens; ++tok) {
          const std::byte* p = pool.data() + l * layout.layer_stride +
                               granted->block_ids[tok / c.block_size] * block_bytes +
                               (tok % c.block_size) * c.tokenBytes();
          bool same = true;
          for (std::uint64_t w = 0; w * 8 < c.tokenBytes(); ++w) {
            std::uint64_t v = 0;
            std::memcpy(&v, p + w * 8, std::min<std::uint64_t>(8, c.tokenBytes() - w * 8));
            const std::uint64_t want = patternWord(l, tok, w);
            same = same && std::memcmp(&v, &want, std::min<std::uint64_t>(8, c.tokenBytes() - w * 8)) == 0;
          }
          if (!same) {
            result = fmt::format("error layer {} token {} arrived corrupted", l, tok);
            break;
          }
        }
      }
    }
    if (!writeFrame(control, result)) break;
  }
  (void)t.deregisterRegion(region.value());
  return 0;
}

// ---- ucx_perftest, the ceiling --------------------------------------------------------------

/// ucx_perftest `test` (ucp_put_bw, ucp_am_bw) between two processes: `iterations` messages of
/// `size` bytes with error handling on (-e) and pre-registered memory (-z), like the transport's;
/// `sleep` selects its wakeup-based wait mode (-I -E sleep) instead of busy polling. Bytes/s.
Result<double> perftestBandwidth(const std::string& perftest, const std::string& test, const UcxEnv& ucx,
                                 std::uint64_t size, std::uint64_t iterations, bool sleep) {
  std::vector<std::string> args = {"-t", test, "-s", std::to_string(size), "-n", std::to_string(iterations), "-w", "20",
                                   "-e", "-z", "-v"};
  if (sleep) args.insert(args.end(), {"-I", "-E", "sleep"});
  PD_ASSIGN_OR_RETURN(const std::string text, runPerftestPair(perftest, args, ucx));
  // CSV: iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
  const std::vector<std::string> cols = lastCsvRow(text);
  if (cols.size() >= 6) {
    const double mb_per_s = std::strtod(cols[5].c_str(), nullptr);
    if (mb_per_s > 0) return mb_per_s * 1024.0 * 1024.0;
  }
  return makeError(ErrorCode::Internal, "could not parse ucx_perftest output: " + text);
}

// ---- the prefill side (parent) --------------------------------------------------------------

/// One transfer of `tokens` tokens; seconds from beginTransfer to the success callback.
Result<double> transferOnce(kvtransfer::Transport& t, int control, kvtransfer::RegionId source,
                            const kvtransfer::CompatInfo& c, std::uint32_t max_tokens, std::uint64_t id,
                            std::uint32_t tokens, bool verify) {
  if (!writeFrame(control, fmt::format("go {} {} {}", id, tokens, verify ? 1 : 0))) {
    return makeError(ErrorCode::PeerFailed, "benchmark receiver process is gone");
  }
  const auto wire = readFrame(control, 60s);
  if (!wire) return makeError(ErrorCode::PeerFailed, "no descriptor from the receiver process");
  if (wire->starts_with("error ")) return makeError(ErrorCode::Internal, "receiver: " + wire->substr(6));
  const std::span<const std::uint8_t> bytes(reinterpret_cast<const std::uint8_t*>(wire->data()), wire->size());
  PD_ASSIGN_OR_RETURN(auto desc, kvtransfer::decodeKvDescriptor(bytes));
  std::vector<kvtransfer::LayerPut> puts;
  puts.reserve(c.num_layers);
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    puts.push_back({kvtransfer::LayerSlice{l, 0, tokens}, source, std::uint64_t{l} * max_tokens * c.tokenBytes()});
  }
  OneShot<Status> done;
  const auto start = Clock::now();
  PD_TRY(t.beginTransfer(desc, start + 60s, [&](const kvtransfer::TransferId&, Status s) { done.set(std::move(s)); }));
  for (const auto& p : puts) PD_TRY(t.put(desc.transfer_id, std::span(&p, 1)));  // layer by layer, as prefill streams
  kvtransfer::CompletionRecord record;
  record.transfer_id = desc.transfer_id;
  record.num_tokens = tokens;
  PD_TRY(t.finish(std::move(record)));
  auto status = done.wait(70s);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!status) return makeError(ErrorCode::Internal, "no transfer callback (a bug: the deadline should have fired)");
  PD_TRY(*status);
  const auto reply = readFrame(control, 60s);
  if (!reply || *reply != "ok") return makeError(ErrorCode::Internal, "receiver: " + reply.value_or("no reply"));
  return seconds;
}

Result<KvBenchResult> runSender(int control, pid_t receiver, const kvtransfer::UcxTransportOptions& options,
                                const KvBenchConfig& cfg, std::uint32_t max_tokens) {
  const auto& c = options.compat;
  const auto fail = [&](const Error& e) {
    (void)writeFrame(control, "quit");
    (void)reapWithin(receiver, 5s);
    return e;
  };
  auto transport = kvtransfer::createUcxTransport(options);
  if (!transport.ok()) return fail(transport.error());
  auto& t = *transport.value();
  const std::string path(kvtransfer::kvDataPathName(kvtransfer::resolveKvDataPath(options.data_path, options.ucx_tls)));
  // Source KV: [layer][max_tokens][token bytes] with the seeded pattern.
  std::vector<std::byte> source(std::uint64_t{c.num_layers} * max_tokens * c.tokenBytes());
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    for (std::uint32_t tok = 0; tok < max_tokens; ++tok) {
      std::byte* p = source.data() + (std::uint64_t{l} * max_tokens + tok) * c.tokenBytes();
      for (std::uint64_t w = 0; w * 8 < c.tokenBytes(); ++w) {
        const std::uint64_t v = patternWord(l, tok, w);
        std::memcpy(p + w * 8, &v, std::min<std::uint64_t>(8, c.tokenBytes() - w * 8));
      }
    }
  }
  auto region = t.registerRegion(source);
  if (!region.ok()) return fail(region.error());
  const std::uint64_t put_size = std::uint64_t{c.block_size} * c.tokenBytes();
  std::vector<KvCase> cases;
  std::uint64_t id = 1;
  for (const std::uint32_t tokens : cfg.tokens) {
    KvCase r;
    r.tokens = tokens;
    r.bytes = kvPayloadBytes(tokens, c.num_layers, c.tokenBytes());
    r.puts = kvPutCount(tokens, c.block_size, c.num_layers);
    auto warm = transferOnce(t, control, region.value(), c, max_tokens, id++, tokens, /*verify=*/true);
    if (!warm.ok()) return fail(warm.error());
    log::info("bench", "{} tokens: warm-up transfer verified byte for byte", tokens);
    for (std::int64_t run = 0; run < cfg.runs; ++run) {
      auto s = transferOnce(t, control, region.value(), c, max_tokens, id++, tokens, false);
      if (!s.ok()) return fail(s.error());
      r.ours_s.push_back(s.value());
      r.ours_bps.push_back(static_cast<double>(r.bytes) / s.value());
      if (!cfg.perftest.empty()) {
        // The ceiling is the best ucp_put_bw of this run over UCX's wait modes (busy polling wins
        // on idle cores, sleeping on busy ones) and settings (UCX's defaults, and the ones the
        // transport applies, which suit tcp better).
        const UcxEnv defaults = {{"TLS", options.ucx_tls}};
        UcxEnv tuned = defaults;
        for (const auto& kv : kvtransfer::ucxSettings(options)) tuned.push_back(kv);
        double best_poll = 0;
        double best_sleep = 0;
        for (const UcxEnv* env : {&defaults, static_cast<const UcxEnv*>(&tuned)}) {
          for (const bool sleep : {false, true}) {
            auto bw = perftestBandwidth(cfg.perftest, "ucp_put_bw", *env, put_size, r.puts, sleep);
            if (!bw.ok()) return fail(bw.error());
            (sleep ? best_sleep : best_poll) = std::max(sleep ? best_sleep : best_poll, bw.value());
          }
        }
        r.perftest_poll_bps.push_back(best_poll);
        r.perftest_sleep_bps.push_back(best_sleep);
        r.perftest_bps.push_back(std::max(best_poll, best_sleep));
        // Context for the am data path: UCX's own active messages (defaults, zero-copy on).
        auto am = perftestBandwidth(cfg.perftest, "ucp_am_bw", defaults, put_size, r.puts, true);
        if (!am.ok()) return fail(am.error());
        r.perftest_am_bps.push_back(am.value());
      }
      log::info("bench", "{} tokens run {}: {:.1f} MB/s, ucx_perftest {:.1f} MB/s", tokens, run + 1,
                r.ours_bps.back() / 1e6, r.perftest_bps.empty() ? 0.0 : r.perftest_bps.back() / 1e6);
    }
    cases.push_back(std::move(r));
  }
  (void)t.deregisterRegion(region.value());
  transport.value().reset();  // before the receiver exits, so that no endpoint sees it vanish
  (void)writeFrame(control, "quit");
  (void)reapWithin(receiver, 10s);
  KvBenchResult result;
  result.ucx_tls = options.ucx_tls;
  result.data_path = path;
  result.put_bytes = put_size;
  result.cases = std::move(cases);
  return result;
}

}  // namespace

Result<std::vector<std::uint32_t>> parseKvTokenList(const std::string& text) {
  std::vector<std::uint32_t> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    std::uint32_t v = 0;
    const auto r = std::from_chars(text.data() + pos, text.data() + comma, v);
    if (r.ec != std::errc() || r.ptr != text.data() + comma || v == 0) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("bench.tokens: '{}' is not a list of token counts", text));
    }
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

double medianOfRuns(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::uint64_t kvPayloadBytes(std::uint32_t tokens, std::uint32_t layers, std::uint64_t token_bytes) {
  return std::uint64_t{tokens} * layers * token_bytes;
}

std::uint64_t kvPutCount(std::uint32_t tokens, std::uint32_t block_size, std::uint32_t layers) {
  return std::uint64_t{(tokens + block_size - 1) / block_size} * layers;
}

double KvCase::ratio() const {
  const double p = medianOfRuns(perftest_bps);
  return p > 0 ? medianOfRuns(ours_bps) / p : 0.0;
}

double KvBenchResult::overallRatio() const {
  std::vector<double> ratios;
  ratios.reserve(cases.size());
  for (const auto& r : cases) ratios.push_back(r.ratio());
  return medianOfRuns(ratios);
}

Result<KvBenchResult> runKvBench(const KvBenchConfig& cfg) {
  if (cfg.tokens.empty()) return makeError(ErrorCode::InvalidArgument, "bench kv: no token counts");
  const std::uint32_t max_tokens = *std::max_element(cfg.tokens.begin(), cfg.tokens.end());
  kvtransfer::CompatInfo compat;
  compat.model_hash = 0xbe9c;
  compat.kv_dtype = DType::BF16;
  compat.block_size = static_cast<std::uint32_t>(cfg.block_size);
  compat.num_layers = static_cast<std::uint32_t>(cfg.layers);
  compat.kv_dim = static_cast<std::uint32_t>(cfg.kv_dim);
  auto options = kvtransfer::ucxOptionsFromConfig(cfg.kvtransfer, compat);

  // Fork before any UCX or thread exists: the child is the decode side.
  int sockets[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets) != 0) {
    return makeError(ErrorCode::Io, fmt::format("socketpair: {}", std::strerror(errno)));
  }
  std::fflush(stdout);
  const pid_t child = ::fork();
  if (child < 0) return makeError(ErrorCode::Io, fmt::format("fork: {}", std::strerror(errno)));
  if (child == 0) {
    ::close(sockets[0]);
    options.name = "bench-decode";
    ::_exit(runReceiver(sockets[1], options, max_tokens));
  }
  ::close(sockets[1]);
  options.name = "bench-prefill";
  auto result = runSender(sockets[0], child, options, cfg, max_tokens);
  ::close(sockets[0]);
  return result;
}

std::string kvReportText(const KvBenchConfig& cfg, const KvBenchResult& r) {
  std::string out = fmt::format(
      "pdserve bench kv: UCX_TLS={}, data path {}, {} layers x block {} x {} BF16 ({}-byte puts), {} runs per case\n",
      r.ucx_tls, r.data_path, cfg.layers, cfg.block_size, cfg.kv_dim, r.put_bytes, cfg.runs);
  out += fmt::format("{:>7} {:>7} {:>5} {:>9} {:>12} {:>13} {:>14} {:>13} {:>7} {:>12}\n", "tokens", "MB", "puts",
                     "median ms", "pdserve MB/s", "put_bw poll", "put_bw sleep", "put ceiling", "ratio", "am_bw");
  for (const auto& c : r.cases) {
    if (c.perftest_bps.empty()) {  // --perftest "": no ceiling
      out += fmt::format("{:7} {:7.1f} {:5} {:9.2f} {:12.1f} {:>13} {:>14} {:>13} {:>7} {:>12}\n", c.tokens,
                         static_cast<double>(c.bytes) / 1e6, c.puts, medianOfRuns(c.ours_s) * 1e3,
                         medianOfRuns(c.ours_bps) / 1e6, "-", "-", "-", "-", "-");
      continue;
    }
    out += fmt::format("{:7} {:7.1f} {:5} {:9.2f} {:12.1f} {:13.1f} {:14.1f} {:13.1f} {:7.3f} {:12.1f}\n", c.tokens,
                       static_cast<double>(c.bytes) / 1e6, c.puts, medianOfRuns(c.ours_s) * 1e3,
                       medianOfRuns(c.ours_bps) / 1e6, medianOfRuns(c.perftest_poll_bps) / 1e6,
                       medianOfRuns(c.perftest_sleep_bps) / 1e6, medianOfRuns(c.perftest_bps) / 1e6, c.ratio(),
                       medianOfRuns(c.perftest_am_bps) / 1e6);
  }
  out += fmt::format(
      "ratio_to_ucx_perftest (median over cases): {:.3f}\n"
      "(MB = 10^6 bytes, medians of the runs. put ceiling = per run the best ucx_perftest ucp_put_bw -e -z\n"
      " over poll/sleep wait modes and UCX default/pdserve settings; ratio = pdserve / put ceiling;\n"
      " am_bw = ucx_perftest ucp_am_bw -e -z in sleep mode with UCX defaults, for context)\n",
      r.overallRatio());
  return out;
}

std::string kvReportJson(const KvBenchConfig& cfg, const KvBenchResult& r) {
  boost::json::array out_cases;
  for (const auto& c : r.cases) {
    boost::json::object o;
    o["tokens"] = c.tokens;
    o["bytes"] = c.bytes;
    o["puts"] = c.puts;
    o["median_seconds"] = medianOfRuns(c.ours_s);
    o["median_bytes_per_second"] = medianOfRuns(c.ours_bps);
    o["ucx_perftest_median_bytes_per_second"] = medianOfRuns(c.perftest_bps);
    o["ratio_to_ucx_perftest"] = c.ratio();
    o["runs_bytes_per_second"] = boost::json::value_from(c.ours_bps);
    o["ucx_perftest_runs_bytes_per_second"] = boost::json::value_from(c.perftest_bps);
    o["ucx_perftest_poll_median_bytes_per_second"] = medianOfRuns(c.perftest_poll_bps);
    o["ucx_perftest_sleep_median_bytes_per_second"] = medianOfRuns(c.perftest_sleep_bps);
    o["ucx_perftest_am_bw_median_bytes_per_second"] = medianOfRuns(c.perftest_am_bps);
    out_cases.push_back(std::move(o));
  }
  boost::json::object o;
  o["ucx_tls"] = r.ucx_tls;
  o["data_path"] = r.data_path;
  o["layers"] = cfg.layers;
  o["block_size"] = cfg.block_size;
  o["kv_dim"] = cfg.kv_dim;
  o["kv_dtype"] = "BF16";
  o["put_bytes"] = r.put_bytes;
  o["runs"] = cfg.runs;
  o["ratio_to_ucx_perftest"] = r.overallRatio();
  o["cases"] = std::move(out_cases);
  return boost::json::serialize(o);
}

}  // namespace pd::bench
