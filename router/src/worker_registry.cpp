#include "pd/router/worker_registry.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "pd/common/http_client.h"
#include "pd/common/log.h"
#include "pd/common/prefix_hash.h"

namespace pd::router {
namespace {

constexpr std::string_view kLog = "router.registry";
using Clock = std::chrono::steady_clock;

}  // namespace

std::string_view roleName(WorkerRole role) {
  return role == WorkerRole::Prefill ? "prefill" : "decode";
}

std::string WorkerAddress::key() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

Result<WorkerAddress> parseWorkerAddress(std::string_view text, std::string_view what) {
  const auto bad = [&](std::string_view why) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("{}: '{}' is not host:port ({})", what, text, why));
  };
  const auto colon = text.rfind(':');
  if (colon == std::string_view::npos) return bad("no port");
  std::string_view host = text.substr(0, colon);
  const std::string_view port_text = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string_view::npos) {
    return bad("an IPv6 address needs brackets");
  }
  if (host.empty()) return bad("empty host");
  unsigned port = 0;
  const auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || ptr != port_text.data() + port_text.size() || port == 0 || port > 65535) {
    return bad("port must be 1..65535");
  }
  return WorkerAddress{std::string(host), static_cast<std::uint16_t>(port)};
}

Result<std::vector<WorkerAddress>> resolveAll(const std::string& name, std::uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const int rc = ::getaddrinfo(name.c_str(), nullptr, &hints, &list);
  if (rc != 0) {
    return makeError(ErrorCode::NotFound, fmt::format("cannot resolve '{}': {}", name, ::gai_strerror(rc)));
  }
  std::vector<WorkerAddress> out;
  for (const addrinfo* a = list; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* addr = nullptr;
    if (a->ai_family == AF_INET) {
      addr = &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr;
    } else if (a->ai_family == AF_INET6) {
      addr = &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr;
    } else {
      continue;
    }
    if (::inet_ntop(a->ai_family, addr, text, sizeof(text)) == nullptr) continue;
    out.push_back(WorkerAddress{text, port});
  }
  ::freeaddrinfo(list);
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.key() < y.key(); });
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) return makeError(ErrorCode::NotFound, fmt::format("'{}' has no IP address", name));
  return out;
}

Result<RegistryOptions> registryOptionsFromConfig(const RouterConfig& config) {
  RegistryOptions o;
  for (const auto& w : config.prefill_workers) {
    PD_ASSIGN_OR_RETURN(auto a, parseWorkerAddress(w, "router.prefill_workers"));
    o.prefill_workers.push_back(std::move(a));
  }
  for (const auto& w : config.decode_workers) {
    PD_ASSIGN_OR_RETURN(auto a, parseWorkerAddress(w, "router.decode_workers"));
    o.decode_workers.push_back(std::move(a));
  }
  if (!config.prefill_service.empty()) {
    PD_ASSIGN_OR_RETURN(auto a, parseWorkerAddress(config.prefill_service, "router.prefill_service"));
    o.prefill_service = std::move(a);
  }
  if (!config.decode_service.empty()) {
    PD_ASSIGN_OR_RETURN(auto a, parseWorkerAddress(config.decode_service, "router.decode_service"));
    o.decode_service = std::move(a);
  }
  o.discovery_interval = std::chrono::milliseconds{config.discovery_interval_ms};
  o.health_interval = std::chrono::milliseconds{config.health_interval_ms};
  o.health_timeout = std::chrono::milliseconds{config.health_timeout_ms};
  o.health_failures = config.health_failures;
  o.model_hash = config.model_hash;
  o.kv_events = resolvePrefillPolicy(config) == "cache_aware";
  o.kv_events_interval = std::chrono::milliseconds{config.kv_events_interval_ms};
  o.kv_index_max_blocks = config.kv_index_max_blocks;
  return o;
}

/// One worker and its poller thread. The state fields are guarded by the registry's mutex; the
/// client belongs to the poller thread (cancel() is the only call from elsewhere).
struct PolledWorker {
  WorkerAddress address;
  WorkerRole role = WorkerRole::Prefill;
  std::string key;
  bool discovered = false;
  // Guarded by Impl::mu_.
  bool in_rotation = false;
  std::string reason = "not polled yet";
  std::int64_t consecutive_failures = 0;
  std::int64_t good_polls = 0;
  std::optional<worker_api::WorkerStatus> status;
  std::int64_t sent_requests = 0;
  std::int64_t sent_tokens = 0;
  std::int64_t in_flight = 0;
  std::int64_t in_flight_tokens = 0;
  bool stop = false;
  // Set once at creation (with RegistryOptions::metrics); the gauges are lock-free.
  struct Gauges {
    metrics::Gauge* in_rotation = nullptr;
    metrics::Gauge* queued = nullptr;
    metrics::Gauge* running = nullptr;
    metrics::Gauge* blocks_free = nullptr;
    metrics::Gauge* blocks_total = nullptr;
    metrics::Gauge* drafts_proposed = nullptr;
    metrics::Gauge* drafts_accepted = nullptr;
  };
  std::optional<Gauges> gauges;
  // The poller's own.
  http::Client client;
  std::thread thread;
  // The KV event follower's own (prefill workers, with kv_events).
  http::Client events_client;
  std::thread events_thread;

  PolledWorker(WorkerAddress a, WorkerRole r, bool d)
      : address(std::move(a)),
        role(r),
        key(address.key()),
        discovered(d),
        client(address.host, address.port),
        events_client(address.host, address.port) {}
};

class WorkerRegistry::Impl {
 public:
  explicit Impl(RegistryOptions options) : options_(std::move(options)), pinned_hash_(options_.model_hash) {
    if (options_.kv_events) index_ = std::make_unique<PrefixIndex>(options_.kv_index_max_blocks, options_.metrics);
  }

  const PrefixIndex* prefixIndex() const { return index_.get(); }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  ~Impl() { stopAll(); }

  void begin() {
    for (const auto& a : options_.prefill_workers) addWorker(a, WorkerRole::Prefill, false);
    for (const auto& a : options_.decode_workers) addWorker(a, WorkerRole::Decode, false);
    if (options_.prefill_service || options_.decode_service) discovery_ = std::thread([this] { discoveryLoop(); });
  }

  std::vector<WorkerView> ready(WorkerRole role) const {
    std::lock_guard lock(mu_);
    std::vector<WorkerView> out;
    std::vector<WorkerView> busy;
    for (const auto& [key, w] : workers(role)) {
      if (!w->in_rotation || !w->status) continue;
      (w->status->busy ? busy : out)
          .push_back(
              WorkerView{w->address, *w->status, w->sent_requests, w->sent_tokens, w->in_flight, w->in_flight_tokens});
    }
    return out.empty() ? busy : out;
  }

  bool hasReady(WorkerRole role) const {
    std::lock_guard lock(mu_);
    for (const auto& [key, w] : workers(role)) {
      if (w->in_rotation) return true;
    }
    return false;
  }

  std::vector<WorkerState> states() const {
    std::lock_guard lock(mu_);
    std::vector<WorkerState> out;
    for (const auto* map : {&prefill_, &decode_}) {
      for (const auto& [key, w] : *map) {
        out.push_back(WorkerState{w->address, w->role, w->discovered, w->in_rotation, w->reason,
                                  w->consecutive_failures, w->good_polls, w->status});
      }
    }
    return out;
  }

  void noteSent(WorkerRole role, const std::string& key, std::int64_t tokens) {
    std::lock_guard lock(mu_);
    auto& map = workers(role);
    if (auto it = map.find(key); it != map.end()) {
      ++it->second->sent_requests;
      it->second->sent_tokens += tokens;
    }
  }

  void noteInFlight(WorkerRole role, const std::string& key, std::int64_t delta, std::int64_t tokens) {
    std::lock_guard lock(mu_);
    auto& map = workers(role);
    if (auto it = map.find(key); it != map.end()) {
      it->second->in_flight = std::max<std::int64_t>(0, it->second->in_flight + delta);
      it->second->in_flight_tokens = std::max<std::int64_t>(0, it->second->in_flight_tokens + tokens);
    }
  }

  void reportFailure(WorkerRole role, const std::string& key, const std::string& why) {
    std::lock_guard lock(mu_);
    auto& map = workers(role);
    if (auto it = map.find(key); it != map.end()) failedLocked(*it->second, why);
  }

 private:
  using WorkerMap = std::map<std::string, std::unique_ptr<PolledWorker>>;

  WorkerMap& workers(WorkerRole role) { return role == WorkerRole::Prefill ? prefill_ : decode_; }
  const WorkerMap& workers(WorkerRole role) const { return role == WorkerRole::Prefill ? prefill_ : decode_; }

  void addWorker(const WorkerAddress& address, WorkerRole role, bool discovered) {
    auto w = std::make_unique<PolledWorker>(address, role, discovered);
    PolledWorker* raw = w.get();
    if (metrics::Registry* m = options_.metrics; m != nullptr) {
      const std::vector<std::string> labels = {"role", "worker"};
      const std::vector<std::string> values = {std::string(roleName(role)), raw->key};
      raw->gauges = PolledWorker::Gauges{
          &m->gauge("pdserve_router_worker_in_rotation", "1 while the router sends this worker requests.", labels)
               .labels(values),
          &m->gauge("pdserve_router_worker_queued_requests", "Requests queued at the worker (last status poll).",
                    labels)
               .labels(values),
          &m->gauge("pdserve_router_worker_running_requests", "Requests running at the worker (last status poll).",
                    labels)
               .labels(values),
          &m->gauge("pdserve_router_worker_kv_blocks_free", "Free KV (decode) or local cache (prefill) blocks.", labels)
               .labels(values),
          &m->gauge("pdserve_router_worker_kv_blocks_total", "KV (decode) or local cache (prefill) blocks.", labels)
               .labels(values),
          &m->gauge("pdserve_router_worker_mtp_drafts_proposed",
                    "MTP drafts the decode worker proposed since it started (last status poll).", labels)
               .labels(values),
          &m->gauge("pdserve_router_worker_mtp_drafts_accepted",
                    "MTP drafts the decode worker accepted since it started (last status poll).", labels)
               .labels(values)};
    }
    {
      std::lock_guard lock(mu_);
      auto& map = workers(role);
      if (stopping_ || map.count(raw->key) != 0) return;
      log::info(kLog, "{} worker {} added{}", roleName(role), raw->key, discovered ? " (discovered)" : "");
      map.emplace(raw->key, std::move(w));
    }
    raw->thread = std::thread([this, raw] { pollLoop(*raw); });
    if (index_ && role == WorkerRole::Prefill) raw->events_thread = std::thread([this, raw] { eventsLoop(*raw); });
  }

  /// Stops and joins the threads of a worker already taken out of the map.
  void retire(std::unique_ptr<PolledWorker> w) {
    if (w->gauges) w->gauges->in_rotation->set(0);
    w->client.cancel();
    w->events_client.cancel();
    if (w->thread.joinable()) w->thread.join();
    if (w->events_thread.joinable()) w->events_thread.join();
    if (index_) index_->forget(w->key);
  }

  void stopAll() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      for (auto* map : {&prefill_, &decode_}) {
        for (auto& [key, w] : *map) {
          w->stop = true;
          w->client.cancel();
          w->events_client.cancel();
        }
      }
    }
    cv_.notify_all();
    if (discovery_.joinable()) discovery_.join();
    for (auto* map : {&prefill_, &decode_}) {
      for (auto& [key, w] : *map) {
        if (w->thread.joinable()) w->thread.join();
        if (w->events_thread.joinable()) w->events_thread.join();
      }
    }
  }

  /// Follows one prefill worker's KV events into the index while it is in rotation.
  void eventsLoop(PolledWorker& w) {
    while (true) {
      std::string model_hash;
      bool in_rotation = false;
      {
        std::lock_guard lock(mu_);
        if (w.stop) return;
        in_rotation = w.in_rotation && w.status.has_value();
        if (in_rotation) model_hash = w.status->model_hash;
      }
      const bool more = in_rotation && readEvents(w, model_hash);
      std::unique_lock lock(mu_);
      if (w.stop) return;
      if (!more) cv_.wait_for(lock, options_.kv_events_interval, [&] { return w.stop; });
    }
  }

  /// One read of `w`'s events into the index; true when the worker says more follow at once.
  bool readEvents(PolledWorker& w, const std::string& model_hash) {
    const PrefixIndex::Cursor cursor = index_->cursor(w.key);
    http::ClientRequest get{
        "GET",
        fmt::format("{}?after={}&instance={}", worker_api::kKvEventsPath, cursor.after, cursor.instance),
        {},
        {}};
    signRequest(options_.auth.get(), get.method, get.target, get.body, get.headers);
    auto response = w.events_client.send(get, options_.health_timeout);
    if (!response.ok() || response.value().status != 200) {
      log::debug(kLog, "prefill worker {}: kv events: {}", w.key,
                 response.ok() ? fmt::format("HTTP {}", response.value().status) : response.error().toString());
      return false;
    }
    auto events = worker_api::parseKvEvents(response.value().body);
    Status applied = okStatus();
    if (!events.ok()) {
      index_->forget(w.key);
      applied = events.error();
    } else if (hash64Hex(events.value().model_hash) != model_hash) {
      index_->forget(w.key);
      applied = makeError(ErrorCode::Corrupt, fmt::format("kv events of model {} from a worker of model {}",
                                                          hash64Hex(events.value().model_hash), model_hash));
    } else {
      applied = index_->apply(w.key, events.value());
    }
    if (!applied.ok()) {
      log::warn(kLog, "prefill worker {}: kv events refused: {}", w.key, applied.error().toString());
      return false;
    }
    return events.value().more;
  }

  void pollLoop(PolledWorker& w) {
    const std::string target(worker_api::kStatusPath);
    while (true) {
      {
        std::lock_guard lock(mu_);
        if (w.stop) return;
      }
      http::ClientRequest poll{"GET", target, {}, {}};
      signRequest(options_.auth.get(), poll.method, poll.target, poll.body, poll.headers);
      auto response = w.client.send(poll, options_.health_timeout);
      Result<worker_api::WorkerStatus> status = makeError(ErrorCode::Internal, "unset");
      if (!response.ok()) {
        status = std::move(response).error();
      } else if (response.value().status != 200) {
        status = worker_api::parseErrorJson(response.value().status, response.value().body);
      } else {
        status = worker_api::parseWorkerStatus(response.value().body);
      }
      std::unique_lock lock(mu_);
      if (w.stop) return;
      if (status.ok()) {
        goodLocked(w, std::move(status).value());
      } else {
        failedLocked(w, "status poll failed: " + status.error().toString());
      }
      publishLocked(w);
      cv_.wait_for(lock, options_.health_interval, [&] { return w.stop; });
    }
  }

  void goodLocked(PolledWorker& w, worker_api::WorkerStatus status) {
    w.consecutive_failures = 0;
    ++w.good_polls;
    w.sent_requests = 0;
    w.sent_tokens = 0;
    std::string reason;
    if (status.role != roleName(w.role)) {
      reason = fmt::format("reports role '{}' in the {} pool", status.role, roleName(w.role));
    } else if (status.draining) {
      reason = "draining";
    } else if (!status.ready && !status.busy) {
      reason = "not ready";
    } else {
      if (pinned_hash_.empty()) {
        pinned_hash_ = status.model_hash;
        log::info(kLog, "model_hash {} pinned from {} worker {}", pinned_hash_, roleName(w.role), w.key);
      }
      if (status.model_hash != pinned_hash_) {
        reason = fmt::format("model_hash {} differs from the deployment's {}", status.model_hash, pinned_hash_);
      }
    }
    w.status = std::move(status);
    const bool in = reason.empty();
    setRotationLocked(w, in, std::move(reason));
  }

  static void publishLocked(const PolledWorker& w) {
    if (!w.gauges) return;
    w.gauges->in_rotation->set(w.in_rotation ? 1 : 0);
    if (!w.status) return;
    w.gauges->queued->set(static_cast<double>(w.status->queued_requests));
    w.gauges->running->set(static_cast<double>(w.status->running_requests));
    w.gauges->blocks_free->set(static_cast<double>(w.status->free_blocks));
    w.gauges->blocks_total->set(static_cast<double>(w.status->total_blocks));
    w.gauges->drafts_proposed->set(static_cast<double>(w.status->drafts_proposed));
    w.gauges->drafts_accepted->set(static_cast<double>(w.status->drafts_accepted));
  }

  void failedLocked(PolledWorker& w, const std::string& why) {
    ++w.consecutive_failures;
    if (!w.in_rotation) {
      if (w.good_polls == 0 || w.consecutive_failures >= options_.health_failures) w.reason = why;
      return;
    }
    if (w.consecutive_failures >= options_.health_failures) {
      setRotationLocked(w, false, fmt::format("{} failures in a row; last: {}", w.consecutive_failures, why));
    }
  }

  void setRotationLocked(PolledWorker& w, bool in, std::string reason) {
    if (in && !w.in_rotation) log::info(kLog, "{} worker {} is in rotation", roleName(w.role), w.key);
    if (!in && w.in_rotation) log::warn(kLog, "{} worker {} is out of rotation: {}", roleName(w.role), w.key, reason);
    w.in_rotation = in;
    w.reason = std::move(reason);
  }

  void discoveryLoop() {
    while (true) {
      resolveService(options_.prefill_service, WorkerRole::Prefill);
      resolveService(options_.decode_service, WorkerRole::Decode);
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, options_.discovery_interval, [&] { return stopping_; })) return;
    }
  }

  void resolveService(const std::optional<WorkerAddress>& service, WorkerRole role) {
    if (!service) return;
    auto found = resolveAll(service->host, service->port);
    if (!found.ok()) {
      // Keep the last known set: a failing resolver should not empty the pool (polls still run).
      log::warn(kLog, "{} service {}: {}", roleName(role), service->key(), found.error().message);
      return;
    }
    std::vector<std::unique_ptr<PolledWorker>> gone;
    std::vector<WorkerAddress> added;
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      auto& map = workers(role);
      for (auto it = map.begin(); it != map.end();) {
        const bool listed = std::any_of(found.value().begin(), found.value().end(),
                                        [&](const WorkerAddress& a) { return a.key() == it->first; });
        if (it->second->discovered && !listed) {
          log::info(kLog, "{} worker {} left service {}", roleName(role), it->first, service->key());
          it->second->stop = true;
          gone.push_back(std::move(it->second));
          it = map.erase(it);
        } else {
          ++it;
        }
      }
      for (const auto& a : found.value()) {
        if (map.count(a.key()) == 0) added.push_back(a);
      }
    }
    cv_.notify_all();
    for (auto& w : gone) retire(std::move(w));
    for (const auto& a : added) addWorker(a, role, true);
  }

  RegistryOptions options_;
  std::unique_ptr<PrefixIndex> index_;  // with kv_events; before the threads that feed it
  mutable std::mutex mu_;
  std::condition_variable cv_;
  WorkerMap prefill_;
  WorkerMap decode_;
  std::string pinned_hash_;
  bool stopping_ = false;
  std::thread discovery_;
};

WorkerRegistry::WorkerRegistry(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
WorkerRegistry::~WorkerRegistry() = default;

Result<std::unique_ptr<WorkerRegistry>> WorkerRegistry::start(RegistryOptions options) {
  if (options.health_failures < 1) return makeError(ErrorCode::InvalidArgument, "health_failures must be >= 1");
  auto impl = std::make_unique<Impl>(std::move(options));
  impl->begin();
  return std::unique_ptr<WorkerRegistry>(new WorkerRegistry(std::move(impl)));
}

std::vector<WorkerView> WorkerRegistry::ready(WorkerRole role) const {
  return impl_->ready(role);
}
bool WorkerRegistry::hasReady(WorkerRole role) const {
  return impl_->hasReady(role);
}
std::vector<WorkerState> WorkerRegistry::workers() const {
  return impl_->states();
}
void WorkerRegistry::noteSent(WorkerRole role, const std::string& worker, std::int64_t tokens) {
  impl_->noteSent(role, worker, tokens);
}
void WorkerRegistry::noteInFlight(WorkerRole role, const std::string& worker, std::int64_t delta, std::int64_t tokens) {
  impl_->noteInFlight(role, worker, delta, tokens);
}
void WorkerRegistry::reportFailure(WorkerRole role, const std::string& worker, const std::string& why) {
  impl_->reportFailure(role, worker, why);
}
const PrefixIndex* WorkerRegistry::prefixIndex() const {
  return impl_->prefixIndex();
}

}  // namespace pd::router
