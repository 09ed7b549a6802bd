#pragma once
// Helpers of the prefill worker process tests (test_prefill_worker.cpp) and of their decode peer
// (prefill_decode_peer.cpp): the decode side of a transfer — a decode KvPool registered on its own
// UCX transport, descriptors into it, expectations and reading the pool back — and a running
// `pdserve prefill` process with its internal API.
//
// Thread rules: one test thread per object; transport callbacks land in testutil::Outcomes.

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/subprocess.h"
#include "pd/common/worker_api.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/model_config.h"
#include "pd/engine/model_hash.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "unit/kvtransfer/kv_test_util.h"

namespace pd::prefill::testsupport {

namespace kvt = pd::kvtransfer;
using namespace std::chrono_literals;

/// The decode worker's side of KV transfers: a pool of `num_blocks` x `block_size` tokens.
class DecodeSide {
 public:
  static Result<std::unique_ptr<DecodeSide>> create(const std::filesystem::path& model_dir, std::int64_t num_blocks,
                                                    std::int64_t block_size, DType dtype, std::string ucx_tls = "tcp") {
    PD_ASSIGN_OR_RETURN(ModelConfig cfg, ModelConfig::load(model_dir));
    PD_ASSIGN_OR_RETURN(std::uint64_t hash, modelHash(model_dir));
    PD_ASSIGN_OR_RETURN(decode::KvPool pool, decode::KvPool::create(cfg, num_blocks, block_size, dtype));
    auto d = std::unique_ptr<DecodeSide>(new DecodeSide(cfg, std::move(pool)));
    d->compat_ = d->pool_.compat(hash, 1);
    kvt::UcxTransportOptions o;
    o.ucx_tls = std::move(ucx_tls);
    o.compat = d->compat_;
    o.connect_timeout = kvt::testutil::kHangGuard;
    o.spin_time = std::chrono::microseconds(50);
    o.name = "decode-side";
    PD_ASSIGN_OR_RETURN(d->transport_, kvt::createUcxTransport(o));
    PD_ASSIGN_OR_RETURN(d->region_, d->transport_->registerRegion(d->pool_.memory()));
    d->registered_ = true;
    const kvt::RegionLayout layout = d->pool_.regionLayout(d->region_);
    PD_ASSIGN_OR_RETURN(d->target_, d->transport_->exportTarget(0, std::span(&layout, 1)));
    return d;
  }
  ~DecodeSide() {
    if (registered_) (void)transport_->deregisterRegion(region_);
  }
  DecodeSide(const DecodeSide&) = delete;
  DecodeSide& operator=(const DecodeSide&) = delete;
  DecodeSide(DecodeSide&&) = delete;
  DecodeSide& operator=(DecodeSide&&) = delete;

  [[nodiscard]] const ModelConfig& config() const { return cfg_; }
  [[nodiscard]] const kvt::CompatInfo& compat() const { return compat_; }
  [[nodiscard]] kvt::Transport& transport() { return *transport_; }
  [[nodiscard]] kvt::testutil::Outcomes& outcomes() { return outcomes_; }

  /// A descriptor for `num_tokens` tokens at `blocks`, and the expectation of its record as
  /// request `id` (arrivals are keyed by it), granted as a decode worker does: the descriptor
  /// carries a fresh random transfer id. `present_tokens`: the leading tokens already in the pool
  /// (KvDescriptor::present_tokens: not sent, and not granted for writing).
  kvt::KvDescriptor expect(std::uint64_t id, std::uint32_t num_tokens, std::vector<std::uint32_t> blocks,
                           std::chrono::milliseconds timeout, std::uint32_t present_tokens = 0) {
    kvt::KvDescriptor d;
    d.compat = compat_;
    d.num_tokens = num_tokens;
    d.present_tokens = present_tokens;
    d.timeout_ms = static_cast<std::uint32_t>(timeout.count());
    d.block_ids = std::move(blocks);
    d.targets.push_back(target_);
    const Status s = transport_->expect(id, kvt::Clock::now() + timeout, outcomes_.onArrival());
    PD_CHECK_MSG(s.ok(), "decode side: expect failed");
    auto granted = transport_->grant(id, std::move(d));
    PD_CHECK_MSG(granted.ok(), "decode side: grant failed");
    return std::move(granted).value();
  }

  /// Layer `layer`'s latents of positions [0, n) of descriptor `d`, as float32 [n, latent_dim].
  [[nodiscard]] std::vector<float> rows(const kvt::KvDescriptor& d, std::int64_t layer, std::int64_t n) const {
    const std::int64_t dim = pool_.latentDim();
    std::vector<std::int32_t> table(d.block_ids.begin(), d.block_ids.end());
    std::vector<float> out(static_cast<std::size_t>(n * dim));
    for (std::int64_t p = 0; p < n; ++p) model::readLatent(pool_.view(), layer, table, p, out.data() + p * dim);
    return out;
  }

 private:
  DecodeSide(ModelConfig cfg, decode::KvPool pool) : cfg_(std::move(cfg)), pool_(std::move(pool)) {}

  ModelConfig cfg_;
  decode::KvPool pool_;
  kvt::CompatInfo compat_;
  kvt::testutil::Outcomes outcomes_;
  std::unique_ptr<kvt::Transport> transport_;  // after the pool and outcomes: goes first
  kvt::RegionId region_ = 0;
  bool registered_ = false;
  kvt::KvTarget target_;
};

/// The body of a PrefillSubmit for `tokens` into descriptor `d`.
inline std::string submitJson(const std::string& id, std::vector<std::int32_t> tokens, const kvt::KvDescriptor& d,
                              std::int64_t timeout_ms, bool logprobs = false) {
  worker_api::PrefillSubmit s;
  s.request_id = id;
  s.token_ids = std::move(tokens);
  s.logprobs = logprobs;
  const std::vector<std::uint8_t> bytes = kvt::encode(d);
  s.kv_descriptor.assign(bytes.begin(), bytes.end());
  s.timeout_ms = timeout_ms;
  return worker_api::toJson(s);
}

#ifdef PD_PDSERVE_BIN
/// A running `pdserve prefill`: spawned with `flags`, serving once constructed (ok()).
class WorkerProcess {
 public:
  explicit WorkerProcess(std::vector<std::string> flags) {
    proc::SpawnOptions o;
    o.argv = {PD_PDSERVE_BIN, "prefill", "--log.level", "warn"};
    o.argv.insert(o.argv.end(), flags.begin(), flags.end());
    o.capture_stderr = false;  // the worker's log goes to the test's output
    auto p = proc::Subprocess::spawn(o);
    if (!p.ok()) return;
    proc_ = std::move(p).value();
    reader_ = std::make_unique<proc::LineReader>(proc_->stdoutFd());
    const auto line = reader_->next(60s);
    const std::string prefix = "PDSERVE_READY role=prefill url=http://";
    if (!line || line->rfind(prefix, 0) != 0) return;
    const std::string hostport = line->substr(prefix.size());
    const auto colon = hostport.rfind(':');
    host_ = hostport.substr(0, colon);
    port_ = static_cast<std::uint16_t>(std::stoi(hostport.substr(colon + 1)));
  }

  [[nodiscard]] bool ok() const { return port_ != 0; }
  [[nodiscard]] proc::Subprocess& process() { return *proc_; }
  [[nodiscard]] proc::LineReader& stdoutLines() { return *reader_; }
  [[nodiscard]] std::uint16_t port() const { return port_; }
  [[nodiscard]] const std::string& host() const { return host_; }

  /// One request on a fresh connection.
  Result<http::ClientResponse> send(const std::string& method, std::string_view path, std::string body = {},
                                    std::chrono::milliseconds timeout = 20s) const {
    http::Client client(host_, port_);
    http::ClientRequest r;
    r.method = method;
    r.target = std::string(path);
    r.body = std::move(body);
    if (!r.body.empty()) r.headers.push_back({"Content-Type", "application/json"});
    return client.send(r, timeout);
  }
  [[nodiscard]] std::optional<worker_api::WorkerStatus> status() const {
    auto r = send("GET", worker_api::kStatusPath);
    if (!r.ok() || r->status != 200) return std::nullopt;
    auto s = worker_api::parseWorkerStatus(r->body);
    if (!s.ok()) return std::nullopt;
    return s.value();
  }
  /// The value of an unlabelled sample `name` in /metrics; nullopt when absent.
  [[nodiscard]] std::optional<double> metric(const std::string& name) const {
    auto r = send("GET", "/metrics");
    if (!r.ok() || r->status != 200) return std::nullopt;
    const std::string& text = r->body;
    std::size_t pos = 0;
    while (pos < text.size()) {
      std::size_t end = text.find('\n', pos);
      if (end == std::string::npos) end = text.size();
      const std::string_view line(text.data() + pos, end - pos);
      if (line.size() > name.size() && line.substr(0, name.size()) == name && line[name.size()] == ' ') {
        return std::stod(std::string(line.substr(name.size() + 1)));
      }
      pos = end + 1;
    }
    return std::nullopt;
  }

 private:
  std::unique_ptr<proc::Subprocess> proc_;
  std::unique_ptr<proc::LineReader> reader_;
  std::string host_;
  std::uint16_t port_ = 0;
};
#endif  // PD_PDSERVE_BIN

}  // namespace pd::prefill::testsupport
