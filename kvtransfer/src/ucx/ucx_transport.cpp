// UcxTransport: Transport over one UCX worker, progressed by one thread it owns.
//
// Everything that touches UCX runs on the progress thread: public methods called from other
// threads are queued to it and wait for their result (runOnProgressThread). UCX callbacks only
// record what happened (an op finished, a peer failed, a record arrived); the loop then advances
// transfers and calls user callbacks outside any UCX call, so user code never re-enters UCX from
// inside ucp_worker_progress.

#include "pd/kvtransfer/ucx_transport.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "pd/common/log.h"
#include "pd/kvtransfer/layout.h"
#include "ucx/ucx_blob_check.h"
#include "ucx/ucx_handles.h"

namespace pd::kvtransfer {
namespace {

constexpr unsigned kRecordAmId = 7;
constexpr unsigned kDataAmId = 8;
constexpr std::size_t kMaxRecordBytes = 64U << 20;
/// Data path am: KV data messages are at most this long, so that each fits one tcp segment
/// (kTcpSegment below): single-segment sends run 3-5x faster than fragmented ones in UCX 1.13.
constexpr std::uint64_t kAmChunkBytes = 112U << 10;
constexpr const char* kTcpSegment = "128K";

// Transport framing in active-message headers (docs/kv-transfer.md, "Data paths"); little-endian.
/// Header of a KV data message (data path am): which request, where the bytes go, and the
/// descriptor's transfer key (Transport::grant).
struct DataHeader {
  std::uint64_t request_id;
  std::uint64_t remote_address;
  std::array<std::uint64_t, 2> key;
};
/// Header of a record message: KV bytes the sender delivered to this target as active messages
/// before it (0 for RMA), so that the receiver holds the record until all of them were copied;
/// and the descriptor's transfer key.
struct RecordHeader {
  std::uint64_t data_bytes;
  std::array<std::uint64_t, 2> key;
};
static_assert(sizeof(DataHeader) == 32 && sizeof(RecordHeader) == 24);
using TransferKey = std::array<std::uint64_t, 2>;

/// 128 random bits from the kernel, never all zero (zero means "not granted").
TransferKey randomTransferKey() {
  TransferKey key{};
  while (key[0] == 0 && key[1] == 0) {
    auto* bytes = reinterpret_cast<std::uint8_t*>(key.data());
    for (std::size_t done = 0; done < sizeof(key);) {
      const ssize_t n = ::getrandom(bytes + done, sizeof(key) - done, 0);
      PD_CHECK_MSG(n > 0 || errno == EINTR, "getrandom failed");
      if (n > 0) done += static_cast<std::size_t>(n);
    }
  }
  return key;
}

/// Every entry of `tls` a host transport, where UCX 1.13 only emulates RMA.
bool hostTransportsOnly(std::string_view tls) {
  constexpr std::string_view kHost[] = {"tcp", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self", "mm"};
  while (!tls.empty()) {
    const auto comma = tls.find(',');
    std::string_view entry = tls.substr(0, comma);
    if (!entry.empty() && entry.front() == '^') return false;  // an exclusion list means "all but"
    if (std::find(std::begin(kHost), std::end(kHost), entry) == std::end(kHost)) return false;
    tls = comma == std::string_view::npos ? std::string_view() : tls.substr(comma + 1);
  }
  return true;
}
/// After a deadline force-closed its endpoints, how long a transfer may still wait for UCX to
/// complete its requests before they are released without completion.
constexpr auto kForceCloseGrace = std::chrono::seconds(1);
/// Bound on waiting for endpoint close requests at shutdown.
constexpr auto kShutdownCloseBound = std::chrono::seconds(1);

/// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] int get() const { return fd_; }

 private:
  int fd_ = -1;
};

std::string peerName(const std::string& key) {
  // Worker addresses are binary; a short hash names the peer in logs and errors.
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : key) {
    h ^= static_cast<std::uint8_t>(c);
    h *= 0x100000001b3ULL;
  }
  return fmt::format("peer-{:08x}", static_cast<std::uint32_t>(h ^ (h >> 32)));
}

/// UCX_NET_DEVICES limiting UCX's network devices to the interface of options.host (see
/// UcxTransportOptions::host); nothing when the host is a wildcard or no limit is safe.
Result<std::vector<std::pair<std::string, std::string>>> interfaceSettings(const UcxTransportOptions& options) {
  const std::string& host = options.host;
  if (host.empty() || host == "0.0.0.0" || host == "::") return std::vector<std::pair<std::string, std::string>>{};
  in_addr v4{};
  in6_addr v6{};
  const bool is_v4 = ::inet_pton(AF_INET, host.c_str(), &v4) == 1;
  const bool is_v6 = !is_v4 && ::inet_pton(AF_INET6, host.c_str(), &v6) == 1;
  if (!is_v4 && !is_v6) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("kvtransfer host '{}' is not a numeric IPv4 or IPv6 address", host));
  }
  ifaddrs* raw = nullptr;
  if (::getifaddrs(&raw) != 0) return makeError(ErrorCode::Io, fmt::format("getifaddrs: {}", std::strerror(errno)));
  const std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> list(raw, &::freeifaddrs);
  for (const ifaddrs* a = list.get(); a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    bool match = false;
    if (is_v4 && a->ifa_addr->sa_family == AF_INET) {
      match = std::memcmp(&reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, &v4, sizeof(v4)) == 0;
    } else if (is_v6 && a->ifa_addr->sa_family == AF_INET6) {
      match = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, &v6, sizeof(v6)) == 0;
    }
    if (!match) continue;
    if ((a->ifa_flags & IFF_LOOPBACK) == 0 && !hostTransportsOnly(options.ucx_tls)) {
      log::warn("kv",
                "{}: UCX_TLS={} may use RDMA devices, which a device list naming {} would drop; UCX's tcp "
                "transport listens on every interface",
                options.name, options.ucx_tls, a->ifa_name);
      return std::vector<std::pair<std::string, std::string>>{};
    }
    return std::vector<std::pair<std::string, std::string>>{{"NET_DEVICES", a->ifa_name}};
  }
  return makeError(ErrorCode::InvalidArgument, fmt::format("kvtransfer host {} is no address of this host", host));
}

/// The blob checks calibrated on this process's own worker address and on the remote key of a
/// small scratch registration (host memory, like every KV region).
Result<ucx::UcxBlobCheck> ownBlobCheck(const ucx::Context& context, std::span<const std::uint8_t> address) {
  std::array<std::byte, 64> scratch{};
  PD_ASSIGN_OR_RETURN(const auto mem, ucx::MemHandle::map(context, scratch.data(), scratch.size()));
  PD_ASSIGN_OR_RETURN(const auto rkey, mem.packRemoteKey());
  return ucx::UcxBlobCheck::create(address, rkey);
}

std::int64_t msUntil(Deadline deadline, Clock::time_point now) {
  return std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
}

class UcxTransport final : public Transport {
 public:
  static Result<std::unique_ptr<Transport>> create(const UcxTransportOptions& options);
  ~UcxTransport() override;
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;
  UcxTransport(UcxTransport&&) = delete;
  UcxTransport& operator=(UcxTransport&&) = delete;

  [[nodiscard]] TransportCapabilities capabilities() const override {
    return {fmt::format("ucx({}; {})", options_.ucx_tls, kvDataPathName(data_path_)), true, true};
  }
  [[nodiscard]] const CompatInfo& compat() const override { return options_.compat; }
  Result<RegionId> registerRegion(std::span<std::byte> memory) override;
  Status deregisterRegion(RegionId region) override;
  Result<KvTarget> exportTarget(std::uint32_t tp_rank, std::span<const RegionLayout> layouts) override;
  Status beginTransfer(const KvDescriptor& descriptor, Deadline deadline, TransferDoneFn on_done) override;
  Status put(std::uint64_t request_id, std::span<const LayerPut> puts) override;
  Status finish(CompletionRecord record) override;
  Status abort(std::uint64_t request_id, ErrorCode code, std::string reason) override;
  Status expect(std::uint64_t request_id, Deadline deadline, ArrivalFn on_arrival) override;
  bool cancelExpect(std::uint64_t request_id) override;
  Result<KvDescriptor> grant(KvDescriptor descriptor) override;
  [[nodiscard]] TransportStats stats() const override { return metrics_.snapshot(); }

 private:
  struct Region {
    ucx::MemHandle mem;
    std::byte* base = nullptr;
    std::size_t length = 0;
    std::vector<std::uint8_t> packed_rkey;
    int users = 0;  // transfers in flight reading from it
  };

  struct Peer {
    UcxTransport* owner = nullptr;
    std::string key;  // the worker address bytes
    std::string name;
    ucx::Endpoint ep;
    ucx::Request probe;  // first flush: completes once the endpoint is wired up
    bool connected = false;
    Deadline connect_deadline;
    std::set<std::uint64_t> transfers;
    // Declared after ep so that they are destroyed before it.
    std::map<std::vector<std::uint8_t>, ucx::RemoteKey> rkeys;
  };

  struct ClosingPeer {
    std::unique_ptr<Peer> peer;
    ucx::Request close;
    Clock::time_point since;
  };

  enum class Stage { Posting, Flushing, Recording };

  struct Link {
    std::string key;  // the peer's address; the Peer may be gone once the transfer failed
    Peer* peer = nullptr;
    std::vector<ucp_rkey_h> rkeys;  // per descriptor region, owned by peer->rkeys
  };

  struct Transfer {
    UcxTransport* owner = nullptr;
    std::uint64_t id = 0;
    KvDescriptor descriptor;
    std::vector<Link> links;
    Deadline deadline;
    Clock::time_point started;
    TransferDoneFn on_done;
    Stage stage = Stage::Posting;
    bool closing_requested = false;          // finish() or abort() called
    Status final_status;                     // what success of the closing sequence reports
    std::vector<std::uint8_t> record_bytes;  // completion or failure record; alive until sent
    std::optional<Error> error;
    bool deadline_fired = false;
    Clock::time_point force_closed_at;
    std::set<RegionId> regions;
    std::vector<std::uint64_t> am_bytes;          // per link: KV bytes sent as active messages
    std::deque<DataHeader> data_headers;          // alive until the transfer ends (UCX may read them late)
    std::vector<RecordHeader> record_headers;     // per link
    std::unordered_map<void*, ucx::Request> ops;  // outstanding puts, flushes, record sends
  };

  /// What grant() lets a request write: data and records with its key; KV data only into the
  /// bytes of its blocks in this transport's regions; a completion record for its token count.
  struct Grant {
    TransferKey key{};
    std::uint32_t num_tokens = 0;
    std::uint64_t block_bytes = 0;
    std::vector<KvRegion> regions;  // this transport's target in the descriptor (keys dropped)
    std::unordered_set<std::uint32_t> blocks;
    [[nodiscard]] bool covers(std::uint64_t address, std::uint64_t length) const;
  };

  struct Expectation {
    Deadline deadline;
    Clock::time_point started;
    ArrivalFn on_arrival;
    std::uint64_t bytes_received = 0;  // data path am
    /// A record that arrived before all of its data: delivered once bytes_received reaches
    /// record_data_bytes (or the deadline fails the receive).
    std::optional<CompletionRecord> held_record;
    std::uint64_t record_data_bytes = 0;
    std::optional<std::string> data_error;  // data outside every region: the receive fails
    std::optional<Grant> grant;
  };

  /// A received record and the data bytes its sender says precede it.
  struct InboxRecord {
    std::vector<std::uint8_t> bytes;
    std::uint64_t data_bytes = 0;
    TransferKey key{};
  };

  /// A rendezvous record being received (ucp_am_recv_data_nbx).
  struct PendingRecv {
    UcxTransport* owner = nullptr;
    std::uint64_t data_bytes = 0;
    TransferKey key{};
    std::vector<std::uint8_t> bytes;
    ucx::Request request;
    bool done = false;
    ucs_status_t status = UCS_OK;
  };

  explicit UcxTransport(const UcxTransportOptions& options, ucx::Context context, ucx::Worker worker,
                        std::vector<std::uint8_t> address, ucx::UcxBlobCheck blob_check, Fd epoll_fd, Fd event_fd);

  // Thread plumbing.
  [[nodiscard]] bool onProgressThread() const { return std::this_thread::get_id() == thread_id_.load(); }
  template <class F>
  auto runOnProgressThread(F&& fn) -> std::invoke_result_t<F&>;
  void wake();
  void run();
  bool runCommands();
  void waitForEvents(Clock::time_point now);
  [[nodiscard]] Deadline nextDeadline() const;
  void shutdown();
  void drainWorker(Clock::time_point until);

  // Loop steps.
  void afterProgress();
  void fireDeadlines(Clock::time_point now);
  void handleInbox();
  void deliverRecord(InboxRecord record);
  void deliverHeld();
  void advance(Transfer& t);
  void advanceDirty();
  void finalize(std::uint64_t id, Status status);
  void failTransfer(Transfer& t, Error error);
  void failPeer(const std::string& key, const Error& error, bool suspect);
  void updatePeerGauges();
  [[nodiscard]] Status cancelledStatus() const;

  // UCX plumbing.
  Result<Peer*> connect(const std::string& key);
  Status post(Transfer& t, ucs_status_ptr_t status, std::string_view what);
  void sendRecord(Transfer& t);
  void flushAll(Transfer& t);
  static void onOpDone(void* request, ucs_status_t status, void* user_data);
  static void onProbeDone(void* request, ucs_status_t status, void* user_data);
  static void onPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t onRecord(void* arg, const void* header, std::size_t header_length, void* data, std::size_t length,
                               const ucp_am_recv_param_t* param);
  static ucs_status_t onData(void* arg, const void* header, std::size_t header_length, void* data, std::size_t length,
                             const ucp_am_recv_param_t* param);
  static void onRecvDataDone(void* request, ucs_status_t status, std::size_t length, void* user_data);

  const UcxTransportOptions options_;
  const KvDataPath data_path_;  // resolved: Rma or ActiveMessage
  const std::uint64_t compat_hash_;
  TransportMetrics metrics_;

  // UCX handles and everything that depends on them, in acquisition order.
  ucx::Context context_;
  ucx::Worker worker_;
  const std::vector<std::uint8_t> address_;
  const ucx::UcxBlobCheck blob_check_;  // what a peer's address and remote keys must look like
  Fd epoll_fd_;
  Fd event_fd_;
  std::map<RegionId, std::unique_ptr<Region>> regions_;
  RegionId next_region_ = 1;
  std::unordered_map<std::string, std::unique_ptr<Peer>> peers_;
  std::vector<ClosingPeer> closing_;
  std::unordered_map<std::string, std::pair<Deadline, std::string>> suspects_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Transfer>> transfers_;
  std::unordered_map<std::uint64_t, Expectation> expectations_;
  std::vector<std::unique_ptr<PendingRecv>> pending_recvs_;

  // Recorded by UCX callbacks, handled by afterProgress().
  std::vector<std::pair<Peer*, ucs_status_t>> failed_peers_;
  std::vector<InboxRecord> inbox_;
  std::set<std::uint64_t> data_complete_;  // held records whose data has now all arrived
  std::set<std::uint64_t> dirty_;
  bool stopping_ = false;

  // Commands from other threads.
  std::mutex mutex_;
  std::deque<std::function<void()>> commands_;
  bool accepting_ = true;
  std::atomic<bool> stop_requested_{false};
  std::atomic<std::thread::id> thread_id_{};
  std::jthread thread_;  // last: started when everything above exists, joined first
};

// ---------------------------------------------------------------------------------------------
// Construction, thread, loop

Result<std::unique_ptr<Transport>> UcxTransport::create(const UcxTransportOptions& options) {
  if (options.ucx_tls.find("tcp") == std::string::npos) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("kvtransfer ucx_tls '{}' must include tcp: shared-memory-only transports refuse "
                                 "peer error handling, so a dead peer could never be reported",
                                 options.ucx_tls));
  }
  auto settings = ucxSettings(options);
  PD_ASSIGN_OR_RETURN(auto devices, interfaceSettings(options));
  settings.insert(settings.end(), devices.begin(), devices.end());
  PD_ASSIGN_OR_RETURN(auto context, ucx::Context::create(options.ucx_tls, settings));
  PD_ASSIGN_OR_RETURN(auto worker, ucx::Worker::create(context));
  PD_ASSIGN_OR_RETURN(auto address, worker.address());
  PD_ASSIGN_OR_RETURN(auto blob_check, ownBlobCheck(context, address));
  PD_ASSIGN_OR_RETURN(const int worker_fd, worker.eventFd());
  Fd epoll_fd(::epoll_create1(EPOLL_CLOEXEC));
  Fd event_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (epoll_fd.get() < 0 || event_fd.get() < 0) {
    return makeError(ErrorCode::Io, fmt::format("epoll/eventfd: {}", std::strerror(errno)));
  }
  for (const int fd : {worker_fd, event_fd.get()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      return makeError(ErrorCode::Io, fmt::format("epoll_ctl: {}", std::strerror(errno)));
    }
  }
  std::unique_ptr<UcxTransport> transport(new UcxTransport(options, std::move(context), std::move(worker),
                                                           std::move(address), std::move(blob_check),
                                                           std::move(epoll_fd), std::move(event_fd)));
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                  UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  am.id = kRecordAmId;
  am.cb = &UcxTransport::onRecord;
  am.arg = transport.get();
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  if (const auto st = ucp_worker_set_am_recv_handler(transport->worker_.get(), &am); st != UCS_OK) {
    return ucx::ucsError("ucp_worker_set_am_recv_handler", st);
  }
  am.id = kDataAmId;
  am.cb = &UcxTransport::onData;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;  // then messages may be delivered out of order: records wait for their bytes
  if (const auto st = ucp_worker_set_am_recv_handler(transport->worker_.get(), &am); st != UCS_OK) {
    return ucx::ucsError("ucp_worker_set_am_recv_handler", st);
  }
  auto* raw = transport.get();
  raw->thread_ = std::jthread([raw] { raw->run(); });
  raw->thread_id_.store(raw->thread_.get_id());
  log::info("kv", "{}: UCX transport up (UCX_TLS={}, data path {}, compat {:016x})", options.name, options.ucx_tls,
            kvDataPathName(raw->data_path_), raw->compat_hash_);
  return std::unique_ptr<Transport>(std::move(transport));
}

UcxTransport::UcxTransport(const UcxTransportOptions& options, ucx::Context context, ucx::Worker worker,
                           std::vector<std::uint8_t> address, ucx::UcxBlobCheck blob_check, Fd epoll_fd, Fd event_fd)
    : options_(options),
      data_path_(resolveKvDataPath(options.data_path, options.ucx_tls)),
      compat_hash_(compatHash(options.compat)),
      metrics_(options.metrics),
      context_(std::move(context)),
      worker_(std::move(worker)),
      address_(std::move(address)),
      blob_check_(std::move(blob_check)),
      epoll_fd_(std::move(epoll_fd)),
      event_fd_(std::move(event_fd)) {}

UcxTransport::~UcxTransport() {
  stop_requested_.store(true);
  wake();
  if (thread_.joinable()) thread_.join();
  // The thread has released every endpoint, transfer and expectation; what remains (regions,
  // unfinished requests) is released below in reverse declaration order.
  if (!regions_.empty()) log::warn("kv", "{}: {} regions still registered at shutdown", options_.name, regions_.size());
}

template <class F>
auto UcxTransport::runOnProgressThread(F&& fn) -> std::invoke_result_t<F&> {
  using R = std::invoke_result_t<F&>;
  if (onProgressThread()) return fn();
  auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
  auto future = task->get_future();
  {
    std::lock_guard lock(mutex_);
    PD_CHECK_MSG(accepting_, "Transport method called while the transport is being destroyed");
    commands_.emplace_back([task] { (*task)(); });
  }
  wake();
  return future.get();
}

void UcxTransport::wake() {
  const std::uint64_t one = 1;
  if (::write(event_fd_.get(), &one, sizeof(one)) < 0 && errno != EAGAIN) {
    log::warn("kv", "{}: eventfd write: {}", options_.name, std::strerror(errno));
  }
}

bool UcxTransport::runCommands() {
  std::deque<std::function<void()>> batch;
  {
    std::lock_guard lock(mutex_);
    batch.swap(commands_);
  }
  for (auto& command : batch) command();
  return !batch.empty();
}

void UcxTransport::run() {
  const std::string thread_name = (options_.name + "-ucx").substr(0, 15);
  pthread_setname_np(pthread_self(), thread_name.c_str());
  auto last_activity = Clock::now();
  while (!stop_requested_.load()) {
    bool active = runCommands();
    for (int i = 0; i < 64 && ucp_worker_progress(worker_.get()) != 0; ++i) active = true;
    afterProgress();
    const auto now = Clock::now();
    fireDeadlines(now);
    if (active) {
      last_activity = now;
      continue;
    }
    if (now - last_activity < options_.spin_time) continue;
    waitForEvents(now);
  }
  shutdown();
}

Deadline UcxTransport::nextDeadline() const {
  Deadline next = Deadline::max();
  for (const auto& [id, t] : transfers_) {
    next = std::min(next, t->deadline_fired ? t->force_closed_at + kForceCloseGrace : t->deadline);
  }
  for (const auto& [id, e] : expectations_) next = std::min(next, e.deadline);
  for (const auto& [key, peer] : peers_) {
    if (!peer->connected) next = std::min(next, peer->connect_deadline);
  }
  return next;
}

void UcxTransport::waitForEvents(Clock::time_point now) {
  const ucs_status_t st = ucp_worker_arm(worker_.get());
  if (st == UCS_ERR_BUSY) return;  // events are pending: progress again
  std::int64_t timeout_ms = 1000;
  const Deadline next = nextDeadline();
  if (next != Deadline::max()) timeout_ms = std::clamp<std::int64_t>(msUntil(next, now), 0, 1000);
  if (st != UCS_OK) timeout_ms = std::min<std::int64_t>(timeout_ms, 1);  // cannot sleep on the fd: poll
  std::array<epoll_event, 4> events{};
  const int n =
      ::epoll_wait(epoll_fd_.get(), events.data(), static_cast<int>(events.size()), static_cast<int>(timeout_ms));
  for (int i = 0; i < n; ++i) {
    if (events[static_cast<std::size_t>(i)].data.fd == event_fd_.get()) {
      std::uint64_t value = 0;
      while (::read(event_fd_.get(), &value, sizeof(value)) > 0) {
      }
    }
  }
}

void UcxTransport::afterProgress() {
  if (!failed_peers_.empty()) {
    auto failed = std::move(failed_peers_);
    failed_peers_.clear();
    for (const auto& report : failed) {
      // The peer may already be closing or replaced; only a live one is failed.
      const Peer* peer = report.first;
      const auto it =
          std::find_if(peers_.begin(), peers_.end(), [peer](const auto& kv) { return kv.second.get() == peer; });
      if (it == peers_.end()) continue;
      const std::string key = it->first;
      failPeer(key,
               makeError(ErrorCode::PeerFailed,
                         fmt::format("{} failed: {}", it->second->name, ucs_status_string(report.second))),
               false);
    }
  }
  for (auto it = pending_recvs_.begin(); it != pending_recvs_.end();) {
    if (!(*it)->done) {
      ++it;
      continue;
    }
    if ((*it)->status == UCS_OK) {
      inbox_.push_back(InboxRecord{std::move((*it)->bytes), (*it)->data_bytes, (*it)->key});
    } else {
      metrics_.recordRejected();
      log::warn("kv", "{}: receiving a record failed: {}", options_.name, ucs_status_string((*it)->status));
    }
    it = pending_recvs_.erase(it);
  }
  handleInbox();
  const auto now = Clock::now();
  std::erase_if(closing_, [&](const ClosingPeer& c) {
    if (c.close.empty() || c.close.status() != UCS_INPROGRESS) return true;
    if (now - c.since > kShutdownCloseBound) {
      log::warn("kv", "{}: closing {} did not complete; releasing it", options_.name, c.peer->name);
      return true;
    }
    return false;
  });
  advanceDirty();
}

void UcxTransport::fireDeadlines(Clock::time_point now) {
  std::vector<std::uint64_t> expired;
  for (const auto& [id, e] : expectations_) {
    if (e.deadline <= now) expired.push_back(id);
  }
  for (const auto id : expired) {
    auto node = expectations_.extract(id);
    const Expectation& e = node.mapped();
    metrics_.receiveFailed(ErrorCode::Timeout);
    const std::string what =
        e.held_record
            ? fmt::format("the record arrived but only {} of its {} data bytes", e.bytes_received, e.record_data_bytes)
            : fmt::format("no completion record ({} data bytes arrived)", e.bytes_received);
    log::warn("kv", "{}: request {}: {} within the deadline; releasing its blocks", options_.name, id, what);
    node.mapped().on_arrival(
        id,
        makeError(ErrorCode::Timeout,
                  fmt::format("KV receive of request {}: deadline expired after {} ms: {}", id,
                              std::chrono::duration_cast<std::chrono::milliseconds>(now - e.started).count(), what)));
  }

  std::vector<std::string> unconnected;
  for (const auto& [key, peer] : peers_) {
    if (!peer->connected && peer->connect_deadline <= now) unconnected.push_back(key);
  }
  for (const auto& key : unconnected) {
    failPeer(key,
             makeError(ErrorCode::PeerFailed,
                       fmt::format("{}: not connected within {} ms", peerName(key), options_.connect_timeout.count())),
             true);
  }

  std::vector<std::uint64_t> late;
  for (const auto& [id, t] : transfers_) {
    if ((!t->deadline_fired && t->deadline <= now) ||
        (t->deadline_fired && now - t->force_closed_at > kForceCloseGrace)) {
      late.push_back(id);
    }
  }
  for (const auto id : late) {
    const auto it = transfers_.find(id);
    if (it == transfers_.end()) continue;
    Transfer& t = *it->second;
    if (t.deadline_fired) {
      // UCX did not complete the requests of a force-closed endpoint: release them unanswered.
      log::error("kv", "{}: request {}: {} requests still outstanding after force close; releasing them", options_.name,
                 id, t.ops.size());
      t.ops.clear();
      dirty_.insert(id);
      continue;
    }
    t.deadline_fired = true;
    t.force_closed_at = now;
    const auto budget = std::chrono::round<std::chrono::milliseconds>(t.deadline - t.started).count();
    failTransfer(t, makeError(ErrorCode::Timeout,
                              fmt::format("KV transfer of request {}: deadline of {} ms expired ({} requests "
                                          "outstanding)",
                                          id, budget, t.ops.size())));
    if (!t.ops.empty()) {
      // The transfer waits on the network: the peer is stalled or the link is cut. Cancel by
      // force-closing its endpoints and stop sending to the peer for a while.
      std::vector<std::string> keys;
      for (const auto& link : t.links) keys.push_back(link.key);
      for (const auto& key : keys) {
        failPeer(key,
                 makeError(ErrorCode::PeerFailed,
                           fmt::format("{} is suspect: request {} missed its deadline", peerName(key), id)),
                 true);
      }
    }
  }
  if (std::erase_if(suspects_, [&](const auto& s) { return s.second.first <= now; }) > 0) updatePeerGauges();
  advanceDirty();
}

void UcxTransport::drainWorker(Clock::time_point until) {
  // Endpoints UCX created for peers that connected to us may still hold wireup messages; UCX
  // 1.13 aborts in ucp_worker_destroy if one is pending (ucp_request_send_state_ff assertion),
  // so flush the whole worker, bounded, before it is destroyed.
  ucp_request_param_t params{};
  const ucs_status_ptr_t flush = ucp_worker_flush_nbx(worker_.get(), &params);
  if (!UCS_PTR_IS_PTR(flush)) return;
  const ucx::Request request(flush);
  while (request.status() == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker_.get());
  if (request.status() == UCS_INPROGRESS)
    log::warn("kv", "{}: worker flush did not complete at shutdown", options_.name);
}

void UcxTransport::shutdown() {
  stopping_ = true;
  // Let connections still in wireup finish first (bounded): UCX 1.13 aborts the *peer* process if
  // we vanish while its wireup reply is pending (a spurious assertion in ucp_request_send_state_ff,
  // removed upstream in openucx/ucx#8175).
  const auto wireup_until = Clock::now() + kShutdownCloseBound;
  const auto wiring = [&] {
    return std::any_of(peers_.begin(), peers_.end(), [](const auto& kv) { return !kv.second->probe.empty(); });
  };
  while (wiring() && Clock::now() < wireup_until) ucp_worker_progress(worker_.get());
  for (auto& [id, t] : transfers_) failTransfer(*t, makeError(ErrorCode::Cancelled, "KV transport shutting down"));
  std::vector<std::string> keys;
  for (const auto& [key, peer] : peers_) keys.push_back(key);
  for (const auto& key : keys) failPeer(key, makeError(ErrorCode::Cancelled, "KV transport shutting down"), false);
  for (auto& [id, t] : transfers_) t->ops.clear();
  advanceDirty();
  auto expectations = std::move(expectations_);
  expectations_.clear();
  for (auto& [id, e] : expectations) {
    metrics_.receiveFailed(ErrorCode::Cancelled);
    e.on_arrival(id, makeError(ErrorCode::Cancelled, "KV transport shutting down"));
  }
  const auto start = Clock::now();
  while (!closing_.empty() && Clock::now() - start < kShutdownCloseBound) {
    ucp_worker_progress(worker_.get());
    std::erase_if(closing_, [](const ClosingPeer& c) { return c.close.empty() || c.close.status() != UCS_INPROGRESS; });
  }
  closing_.clear();
  pending_recvs_.clear();
  drainWorker(start + kShutdownCloseBound);
  {
    std::lock_guard lock(mutex_);
    accepting_ = false;
  }
  runCommands();  // commands queued while stopping answer Cancelled
  updatePeerGauges();
}

Status UcxTransport::cancelledStatus() const {
  return makeError(ErrorCode::Cancelled, fmt::format("{}: KV transport is shutting down", options_.name));
}

void UcxTransport::updatePeerGauges() {
  metrics_.setPeers(static_cast<std::int64_t>(peers_.size()), static_cast<std::int64_t>(suspects_.size()));
}

// ---------------------------------------------------------------------------------------------
// Memory

Result<RegionId> UcxTransport::registerRegion(std::span<std::byte> memory) {
  return runOnProgressThread([&]() -> Result<RegionId> {
    if (stopping_) return cancelledStatus().error();
    if (memory.empty()) return makeError(ErrorCode::InvalidArgument, "cannot register an empty region");
    PD_ASSIGN_OR_RETURN(auto mem, ucx::MemHandle::map(context_, memory.data(), memory.size()));
    PD_ASSIGN_OR_RETURN(auto rkey, mem.packRemoteKey());
    const RegionId id = next_region_++;
    regions_.emplace(
        id, std::make_unique<Region>(Region{std::move(mem), memory.data(), memory.size(), std::move(rkey), 0}));
    metrics_.regionRegistered();
    return id;
  });
}

Status UcxTransport::deregisterRegion(RegionId region) {
  return runOnProgressThread([&]() -> Status {
    const auto it = regions_.find(region);
    if (it == regions_.end()) return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", region));
    if (it->second->users > 0) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("region {} is read by {} transfers in flight", region, it->second->users));
    }
    regions_.erase(it);
    metrics_.regionDeregistered();
    return okStatus();
  });
}

Result<KvTarget> UcxTransport::exportTarget(std::uint32_t tp_rank, std::span<const RegionLayout> layouts) {
  return runOnProgressThread([&]() -> Result<KvTarget> {
    KvTarget target;
    target.tp_rank = tp_rank;
    target.worker_address = address_;
    for (const auto& layout : layouts) {
      const auto it = regions_.find(layout.region);
      if (it == regions_.end())
        return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", layout.region));
      const Region& r = *it->second;
      if (layout.offset >= r.length) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("offset {} is past region {}'s {} bytes", layout.offset, layout.region, r.length));
      }
      target.regions.push_back(KvRegion{reinterpret_cast<std::uint64_t>(r.base) + layout.offset,
                                        r.length - layout.offset, layout.first_layer, layout.num_layers,
                                        layout.layer_stride, layout.block_stride, r.packed_rkey});
    }
    return target;
  });
}

// ---------------------------------------------------------------------------------------------
// Sending

Result<UcxTransport::Peer*> UcxTransport::connect(const std::string& key) {
  if (const auto it = peers_.find(key); it != peers_.end()) return it->second.get();
  auto peer = std::make_unique<Peer>();
  peer->owner = this;
  peer->key = key;
  peer->name = peerName(key);
  const std::span<const std::uint8_t> address(reinterpret_cast<const std::uint8_t*>(key.data()), key.size());
  PD_ASSIGN_OR_RETURN(peer->ep, ucx::Endpoint::create(worker_, address, &UcxTransport::onPeerError, peer.get()));
  peer->connect_deadline = Clock::now() + options_.connect_timeout;
  // A flush completes after the endpoint's wireup round trip: our connect confirmation.
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  params.cb.send = &UcxTransport::onProbeDone;
  params.user_data = peer.get();
  const ucs_status_ptr_t probe = ucp_ep_flush_nbx(peer->ep.get(), &params);
  if (UCS_PTR_IS_ERR(probe)) return ucx::ucsError(fmt::format("connecting to {}", peer->name), UCS_PTR_STATUS(probe));
  if (UCS_PTR_IS_PTR(probe)) {
    peer->probe = ucx::Request(probe);
  } else {
    peer->connected = true;
  }
  log::debug("kv", "{}: connecting to {}", options_.name, peer->name);
  Peer* raw = peer.get();
  peers_.emplace(key, std::move(peer));
  updatePeerGauges();
  return raw;
}

Status UcxTransport::beginTransfer(const KvDescriptor& descriptor, Deadline deadline, TransferDoneFn on_done) {
  PD_CHECK(on_done != nullptr);
  return runOnProgressThread([&]() -> Status {
    if (stopping_) return cancelledStatus();
    PD_TRY(checkCompatible(options_.compat, descriptor.compat));
    PD_TRY(validateDescriptor(descriptor));
    // Nothing from the network reaches UCX unchecked: UCX parses addresses and keys without
    // bounds and aborts on some malformed ones (docs/kv-transfer.md, "What reaches UCX").
    for (std::size_t ti = 0; ti < descriptor.targets.size(); ++ti) {
      const KvTarget& target = descriptor.targets[ti];
      if (Status s = blob_check_.checkWorkerAddress(target.worker_address); !s.ok()) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("KV descriptor: target {} (tp rank {}): {}", ti,
                                                                 target.tp_rank, s.error().message));
      }
      for (std::size_t ri = 0; ri < target.regions.size(); ++ri) {
        if (Status s = blob_check_.checkRemoteKey(target.regions[ri].rkey); !s.ok()) {
          return makeError(ErrorCode::InvalidArgument,
                           fmt::format("KV descriptor: target {} region {}: {}", ti, ri, s.error().message));
        }
      }
    }
    const std::uint64_t id = descriptor.request_id;
    if (transfers_.contains(id)) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already being transferred", id));
    }
    const auto now = Clock::now();
    auto t = std::make_unique<Transfer>();
    t->owner = this;
    t->id = id;
    t->descriptor = descriptor;
    t->started = now;
    t->deadline = std::min(deadline, now + std::chrono::milliseconds(descriptor.timeout_ms));
    t->on_done = std::move(on_done);
    for (const auto& target : descriptor.targets) {
      const std::string key(target.worker_address.begin(), target.worker_address.end());
      if (const auto s = suspects_.find(key); s != suspects_.end() && s->second.first > now) {
        return makeError(ErrorCode::PeerFailed,
                         fmt::format("{} (tp rank {}) is suspect for {} ms more: {}", peerName(key), target.tp_rank,
                                     msUntil(s->second.first, now), s->second.second));
      }
      PD_ASSIGN_OR_RETURN(Peer * peer, connect(key));
      Link link{key, peer, {}};
      for (const auto& region : target.regions) {
        if (data_path_ != KvDataPath::Rma) break;  // active messages need no remote keys
        auto rk = peer->rkeys.find(region.rkey);
        if (rk == peer->rkeys.end()) {
          PD_ASSIGN_OR_RETURN(auto unpacked, ucx::RemoteKey::unpack(peer->ep, region.rkey));
          rk = peer->rkeys.emplace(region.rkey, std::move(unpacked)).first;
        }
        link.rkeys.push_back(rk->second.get());
      }
      t->links.push_back(std::move(link));
    }
    for (auto& link : t->links) link.peer->transfers.insert(id);
    t->am_bytes.assign(t->links.size(), 0);
    metrics_.transferStarted();
    log::debug("kv", "{}: request {}: transfer begun to {} targets, {} bytes per target, deadline {} ms", options_.name,
               id, descriptor.targets.size(), requestKvBytes(descriptor), msUntil(t->deadline, now));
    transfers_.emplace(id, std::move(t));
    return okStatus();
  });
}

Status UcxTransport::post(Transfer& t, ucs_status_ptr_t status, std::string_view what) {
  if (UCS_PTR_IS_ERR(status)) {
    const Error e = ucx::ucsError(fmt::format("request {}: {}", t.id, what), UCS_PTR_STATUS(status));
    failTransfer(t, e);
    return e;
  }
  if (UCS_PTR_IS_PTR(status)) t.ops.emplace(status, ucx::Request(status));
  return okStatus();
}

Status UcxTransport::put(std::uint64_t request_id, std::span<const LayerPut> puts) {
  return runOnProgressThread([&]() -> Status {
    if (stopping_) return cancelledStatus();
    const auto it = transfers_.find(request_id);
    if (it == transfers_.end()) {
      return makeError(ErrorCode::NotFound, fmt::format("request {} is not being transferred", request_id));
    }
    Transfer& t = *it->second;
    if (t.error) return *t.error;
    if (t.closing_requested) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("request {}: put after finish/abort", request_id));
    }
    // Plan everything first so that a bad slice posts nothing.
    struct Planned {
      Region* region;
      const LayerPut* put;
      std::vector<std::vector<PlannedPut>> per_target;
    };
    std::vector<Planned> plans;
    const std::uint64_t token_bytes = t.descriptor.compat.tokenBytes();
    for (const auto& lp : puts) {
      const auto r = regions_.find(lp.local_region);
      if (r == regions_.end()) {
        return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", lp.local_region));
      }
      const std::uint64_t bytes = std::uint64_t{lp.slice.num_tokens} * token_bytes;
      if (lp.local_offset > r->second->length || bytes > r->second->length - lp.local_offset) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("request {}: {} bytes at offset {} are past local region {} ({} bytes)",
                                     request_id, bytes, lp.local_offset, lp.local_region, r->second->length));
      }
      Planned plan{r->second.get(), &lp, {}};
      for (std::size_t ti = 0; ti < t.links.size(); ++ti) {
        PD_ASSIGN_OR_RETURN(auto planned, planLayerPuts(t.descriptor, ti, lp.slice));
        plan.per_target.push_back(std::move(planned));
      }
      plans.push_back(std::move(plan));
    }
    for (const auto& plan : plans) {
      if (t.regions.insert(plan.put->local_region).second) ++plan.region->users;
      const std::byte* source = plan.region->base + plan.put->local_offset;
      for (std::size_t ti = 0; ti < t.links.size(); ++ti) {
        const Link& link = t.links[ti];
        for (const auto& p : plan.per_target[ti]) {
          ucp_request_param_t params{};
          params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
          params.cb.send = &UcxTransport::onOpDone;
          params.user_data = &t;
          params.memh = plan.region->mem.get();
          if (data_path_ == KvDataPath::Rma) {
            const auto st = ucp_put_nbx(link.peer->ep.get(), source + p.local_offset, p.length, p.remote_address,
                                        link.rkeys[p.region_index], &params);
            PD_TRY(post(t, st, "put"));
          } else {
            // Eager: the receiver copies each message as it arrives and never has to fetch it.
            params.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
            params.flags = UCP_AM_SEND_FLAG_EAGER;
            for (std::uint64_t done = 0; done < p.length;) {
              const std::uint64_t n = std::min(kAmChunkBytes, p.length - done);
              const DataHeader& header =
                  t.data_headers.emplace_back(DataHeader{t.id, p.remote_address + done, t.descriptor.transfer_key});
              const auto st = ucp_am_send_nbx(link.peer->ep.get(), kDataAmId, &header, sizeof(header),
                                              source + p.local_offset + done, n, &params);
              PD_TRY(post(t, st, "KV data send"));
              done += n;
            }
            t.am_bytes[ti] += p.length;
          }
          metrics_.addBytesPut(p.length);
        }
      }
    }
    return okStatus();
  });
}

void UcxTransport::flushAll(Transfer& t) {
  std::set<Peer*> flushed;
  for (const auto& link : t.links) {
    if (!flushed.insert(link.peer).second) continue;
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    params.cb.send = &UcxTransport::onOpDone;
    params.user_data = &t;
    if (!post(t, ucp_ep_flush_nbx(link.peer->ep.get(), &params), "flush").ok()) return;
  }
}

void UcxTransport::sendRecord(Transfer& t) {
  t.record_headers.clear();
  for (std::size_t ti = 0; ti < t.links.size(); ++ti) {
    t.record_headers.push_back(RecordHeader{t.am_bytes[ti], t.descriptor.transfer_key});
  }
  for (std::size_t ti = 0; ti < t.links.size(); ++ti) {
    const Link& link = t.links[ti];
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    params.cb.send = &UcxTransport::onOpDone;
    params.user_data = &t;
    params.flags = UCP_AM_SEND_FLAG_EAGER;
    const auto st = ucp_am_send_nbx(link.peer->ep.get(), kRecordAmId, &t.record_headers[ti], sizeof(RecordHeader),
                                    t.record_bytes.data(), t.record_bytes.size(), &params);
    if (!post(t, st, "record send").ok()) return;
    metrics_.recordSent();
  }
  // A second flush: success is reported only once the record's send is flushed to the peer.
  flushAll(t);
}

Status UcxTransport::finish(CompletionRecord record) {
  return runOnProgressThread([&]() -> Status {
    if (stopping_) return cancelledStatus();
    const auto it = transfers_.find(record.request_id);
    if (it == transfers_.end()) {
      return makeError(ErrorCode::NotFound, fmt::format("request {} is not being transferred", record.request_id));
    }
    Transfer& t = *it->second;
    if (t.error) return *t.error;
    if (t.closing_requested) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("request {}: finished twice", record.request_id));
    }
    record.compat_hash = compat_hash_;
    t.record_bytes = encode(record);
    t.closing_requested = true;
    t.final_status = okStatus();
    advance(t);
    return okStatus();
  });
}

Status UcxTransport::abort(std::uint64_t request_id, ErrorCode code, std::string reason) {
  return runOnProgressThread([&]() -> Status {
    const auto it = transfers_.find(request_id);
    if (it == transfers_.end()) {
      return makeError(ErrorCode::NotFound, fmt::format("request {} is not being transferred", request_id));
    }
    Transfer& t = *it->second;
    const Error cancelled = makeError(ErrorCode::Cancelled, fmt::format("request {} aborted: {}", request_id, reason));
    if (t.error || t.closing_requested || stopping_) {
      failTransfer(t, cancelled);
      advance(t);
      return okStatus();
    }
    // The failure record goes out after a flush, like a completion record, so that the
    // receiver may reuse the blocks as soon as it reads it.
    t.record_bytes = encode(FailureRecord{request_id, compat_hash_, code, std::move(reason)});
    t.closing_requested = true;
    t.final_status = cancelled;
    advance(t);
    return okStatus();
  });
}

void UcxTransport::failTransfer(Transfer& t, Error error) {
  if (!t.error) {
    log::warn("kv", "{}: request {}: {}", options_.name, t.id, error.message);
    t.error = std::move(error);
  }
  dirty_.insert(t.id);
}

void UcxTransport::advance(Transfer& t) {
  if (t.error) {
    if (t.ops.empty()) finalize(t.id, *t.error);
    return;
  }
  if (!t.closing_requested) return;
  // Posting -> Flushing: the flush is posted behind the puts at once; it completes when they are
  // remotely complete. Flushing -> Recording once everything completed: the record (then a
  // second flush) goes out. Recording -> done once those completed too.
  if (t.stage == Stage::Posting) {
    t.stage = Stage::Flushing;
    flushAll(t);
  }
  if (t.error || !t.ops.empty()) return;
  if (t.stage == Stage::Flushing) {
    t.stage = Stage::Recording;
    sendRecord(t);
  }
  if (t.error || !t.ops.empty()) return;
  finalize(t.id, t.final_status);
}

void UcxTransport::advanceDirty() {
  while (!dirty_.empty()) {
    const std::uint64_t id = *dirty_.begin();
    dirty_.erase(dirty_.begin());
    const auto it = transfers_.find(id);
    if (it != transfers_.end()) advance(*it->second);
  }
}

void UcxTransport::finalize(std::uint64_t id, Status status) {
  auto node = transfers_.extract(id);
  if (node.empty()) return;
  Transfer& t = *node.mapped();
  PD_CHECK(t.ops.empty());
  for (const RegionId r : t.regions) {
    if (const auto it = regions_.find(r); it != regions_.end()) --it->second->users;
  }
  for (const auto& link : t.links) {
    if (const auto it = peers_.find(link.key); it != peers_.end() && it->second.get() == link.peer) {
      it->second->transfers.erase(id);
    }
  }
  if (status.ok()) {
    metrics_.transferSucceeded(Clock::now() - t.started);
    log::debug("kv", "{}: request {}: transfer complete", options_.name, id);
  } else {
    metrics_.transferFailed(status.error().code);
  }
  t.on_done(id, std::move(status));
}

void UcxTransport::failPeer(const std::string& key, const Error& error, bool suspect) {
  const auto it = peers_.find(key);
  if (it == peers_.end()) return;
  std::unique_ptr<Peer> peer = std::move(it->second);
  peers_.erase(it);
  if (peer->transfers.empty() && !suspect) {
    log::info("kv", "{}: {} (no transfer in flight; endpoint dropped)", options_.name, error.message);
  } else {
    log::warn("kv", "{}: {}{}", options_.name, error.message, suspect ? " (marked suspect)" : "");
  }
  for (const auto id : peer->transfers) {
    if (const auto t = transfers_.find(id); t != transfers_.end()) failTransfer(*t->second, error);
  }
  // Force close completes every request on the endpoint (callbacks may run inside this call),
  // which lets the transfers above finish failing.
  ClosingPeer closing{nullptr, peer->ep.close(/*force=*/true), Clock::now()};
  peer->probe = ucx::Request{};
  peer->rkeys.clear();
  // No callback names this peer any more; forget reports queued for it.
  std::erase_if(failed_peers_, [&](const auto& failed) { return failed.first == peer.get(); });
  closing.peer = std::move(peer);
  closing_.push_back(std::move(closing));
  if (suspect) suspects_[key] = {Clock::now() + options_.peer_suspect_time, error.message};
  updatePeerGauges();
}

// ---------------------------------------------------------------------------------------------
// Receiving

Status UcxTransport::expect(std::uint64_t request_id, Deadline deadline, ArrivalFn on_arrival) {
  PD_CHECK(on_arrival != nullptr);
  return runOnProgressThread([&]() -> Status {
    if (stopping_) return cancelledStatus();
    if (expectations_.contains(request_id)) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already expected", request_id));
    }
    expectations_.emplace(request_id, Expectation{deadline, Clock::now(), std::move(on_arrival)});
    metrics_.receiveExpected();
    return okStatus();
  });
}

bool UcxTransport::cancelExpect(std::uint64_t request_id) {
  return runOnProgressThread([&]() -> bool {
    auto node = expectations_.extract(request_id);
    if (node.empty()) return false;
    metrics_.receiveFailed(ErrorCode::Cancelled);
    node.mapped().on_arrival(
        request_id, makeError(ErrorCode::Cancelled, fmt::format("receive of request {} cancelled", request_id)));
    return true;
  });
}

Result<KvDescriptor> UcxTransport::grant(KvDescriptor descriptor) {
  return runOnProgressThread([&]() -> Result<KvDescriptor> {
    if (stopping_) return cancelledStatus().error();
    const std::uint64_t id = descriptor.request_id;
    const auto it = expectations_.find(id);
    if (it == expectations_.end()) {
      return makeError(ErrorCode::NotFound, fmt::format("request {} is not expected", id));
    }
    PD_TRY(validateDescriptor(descriptor));
    const auto target = std::find_if(descriptor.targets.begin(), descriptor.targets.end(),
                                     [&](const KvTarget& t) { return t.worker_address == address_; });
    if (target == descriptor.targets.end()) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("request {}: the descriptor lists no target at this transport's address", id));
    }
    const CompatInfo& c = descriptor.compat;
    Grant g;
    g.key = randomTransferKey();
    g.num_tokens = descriptor.num_tokens;
    g.block_bytes = std::uint64_t{c.block_size} * c.tokenBytes();
    g.regions = target->regions;
    for (auto& r : g.regions) r.rkey.clear();
    const std::uint64_t blocks = (std::uint64_t{descriptor.num_tokens} + c.block_size - 1) / c.block_size;
    g.blocks.insert(descriptor.block_ids.begin(), descriptor.block_ids.begin() + static_cast<std::ptrdiff_t>(blocks));
    descriptor.transfer_key = g.key;
    it->second.grant = std::move(g);
    return descriptor;
  });
}

bool UcxTransport::Grant::covers(std::uint64_t address, std::uint64_t length) const {
  // Piece by piece (a message may span consecutive blocks): each piece must lie in one granted
  // block of some layer of a granted region. Layouts validated by validateDescriptor never
  // overlap, so the first match is the only one.
  while (length > 0) {
    std::uint64_t piece = 0;
    for (const KvRegion& r : regions) {
      if (address < r.base_address || address - r.base_address >= r.length) continue;
      const std::uint64_t offset = address - r.base_address;
      for (std::uint64_t l = 0; l < r.num_layers && piece == 0; ++l) {
        if (r.layer_stride != 0 && l > offset / r.layer_stride) break;
        if (r.layer_stride == 0 && l > 0) break;
        const std::uint64_t in_layer = offset - l * r.layer_stride;
        const std::uint64_t block = in_layer / r.block_stride;
        const std::uint64_t within = in_layer % r.block_stride;
        if (within < block_bytes && block <= UINT32_MAX && blocks.contains(static_cast<std::uint32_t>(block))) {
          piece = std::min(length, block_bytes - within);
        }
      }
      if (piece != 0) break;
    }
    if (piece == 0) return false;
    address += piece;
    length -= piece;
  }
  return true;
}

void UcxTransport::handleInbox() {
  while (!inbox_.empty()) {
    auto batch = std::move(inbox_);
    inbox_.clear();
    for (auto& record : batch) deliverRecord(std::move(record));
  }
  deliverHeld();
}

void UcxTransport::deliverRecord(InboxRecord record) {
  metrics_.recordReceived();
  auto decoded = decodeRecord(record.bytes);
  if (!decoded.ok()) {
    metrics_.recordRejected();
    log::warn("kv", "{}: dropped a record: {}", options_.name, decoded.error().message);
    return;
  }
  const bool is_completion = std::holds_alternative<CompletionRecord>(decoded.value());
  const std::uint64_t id = is_completion ? std::get<CompletionRecord>(decoded.value()).request_id
                                         : std::get<FailureRecord>(decoded.value()).request_id;
  const std::uint64_t hash = is_completion ? std::get<CompletionRecord>(decoded.value()).compat_hash
                                           : std::get<FailureRecord>(decoded.value()).compat_hash;
  const auto it = expectations_.find(id);
  if (it == expectations_.end() || it->second.held_record) {
    metrics_.recordRejected();
    log::warn("kv", "{}: dropped a record for request {}, which is not expected (late or duplicate)", options_.name,
              id);
    return;
  }
  const std::optional<Grant>& granted = it->second.grant;
  if (granted && record.key != granted->key) {
    metrics_.recordRejected();
    log::warn("kv", "{}: dropped a record for request {} without its transfer key", options_.name, id);
    return;
  }
  if (granted && is_completion && std::get<CompletionRecord>(decoded.value()).num_tokens != granted->num_tokens) {
    auto node = expectations_.extract(it);
    metrics_.receiveFailed(ErrorCode::Corrupt);
    node.mapped().on_arrival(
        id, makeError(ErrorCode::Corrupt, fmt::format("KV receive of request {}: the completion record claims {} "
                                                      "tokens, the request holds blocks for {}",
                                                      id, std::get<CompletionRecord>(decoded.value()).num_tokens,
                                                      node.mapped().grant->num_tokens)));
    return;
  }
  if (hash == compat_hash_ && is_completion && record.data_bytes > it->second.bytes_received) {
    // Active messages may overtake each other: wait for the rest of the data (or the deadline).
    it->second.held_record = std::move(std::get<CompletionRecord>(decoded.value()));
    it->second.record_data_bytes = record.data_bytes;
    return;
  }
  auto node = expectations_.extract(it);
  auto& on_arrival = node.mapped().on_arrival;
  if (hash != compat_hash_) {
    metrics_.receiveFailed(ErrorCode::Unsupported);
    on_arrival(id, makeError(ErrorCode::Unsupported,
                             fmt::format("record of request {} carries compatibility hash {:016x}, ours is {:016x}", id,
                                         hash, compat_hash_)));
    return;
  }
  if (is_completion) {
    metrics_.receiveSucceeded(Clock::now() - node.mapped().started);
    on_arrival(id, std::move(std::get<CompletionRecord>(decoded.value())));
  } else {
    auto& failure = std::get<FailureRecord>(decoded.value());
    metrics_.receiveFailed(failure.code);
    // A retry's data may overtake this record (data is copied at once, records wait for this
    // pass): bytes beyond the failed sender's count go to the expectation that on_arrival may
    // re-arm for the same request (decode's prefill retries, docs/internal-api.md).
    const std::uint64_t early =
        node.mapped().bytes_received > record.data_bytes ? node.mapped().bytes_received - record.data_bytes : 0;
    on_arrival(id, makeError(failure.code, fmt::format("prefill side failed request {}: {}", id, failure.message)));
    if (const auto again = expectations_.find(id); again != expectations_.end()) {
      again->second.bytes_received += early;
      // The re-armed receive waits for a retry of the same descriptor: the same grant holds.
      if (!again->second.grant) again->second.grant = std::move(node.mapped().grant);
    }
  }
}

void UcxTransport::deliverHeld() {
  while (!data_complete_.empty()) {
    const std::uint64_t id = *data_complete_.begin();
    data_complete_.erase(data_complete_.begin());
    auto node = expectations_.extract(id);
    if (node.empty()) continue;
    Expectation& e = node.mapped();
    if (e.data_error) {
      metrics_.receiveFailed(ErrorCode::Corrupt);
      e.on_arrival(id, makeError(ErrorCode::Corrupt, fmt::format("KV receive of request {}: {}", id, *e.data_error)));
    } else if (e.held_record && e.bytes_received >= e.record_data_bytes) {
      metrics_.receiveSucceeded(Clock::now() - e.started);
      e.on_arrival(id, std::move(*e.held_record));
    } else {
      expectations_.insert(std::move(node));  // not complete after all
    }
  }
}

// ---------------------------------------------------------------------------------------------
// UCX callbacks: record and return.

void UcxTransport::onOpDone(void* request, ucs_status_t status, void* user_data) {
  auto* t = static_cast<Transfer*>(user_data);
  if (status != UCS_OK && !t->error) {
    t->error = ucx::ucsError(fmt::format("KV transfer of request {} to the peer failed", t->id), status);
  }
  t->owner->dirty_.insert(t->id);
  t->ops.erase(request);  // frees the request
}

void UcxTransport::onProbeDone(void* /*request*/, ucs_status_t status, void* user_data) {
  auto* peer = static_cast<Peer*>(user_data);
  if (status == UCS_OK) {
    peer->connected = true;
  } else {
    peer->owner->failed_peers_.emplace_back(peer, status);
  }
  peer->probe = ucx::Request{};  // frees the request
}

void UcxTransport::onPeerError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  peer->owner->failed_peers_.emplace_back(peer, status);
}

ucs_status_t UcxTransport::onRecord(void* arg, const void* header, std::size_t header_length, void* data,
                                    std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  if (header_length != sizeof(RecordHeader)) {
    self->metrics_.recordRejected();
    log::warn("kv", "{}: dropped a record with a {}-byte header", self->options_.name, header_length);
    return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ? UCS_ERR_UNSUPPORTED : UCS_OK;
  }
  RecordHeader framing{};
  std::memcpy(&framing, header, sizeof(framing));
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    const auto* bytes = static_cast<const std::uint8_t*>(data);
    self->inbox_.push_back(
        InboxRecord{std::vector<std::uint8_t>(bytes, bytes + length), framing.data_bytes, framing.key});
    return UCS_OK;
  }
  if (length > kMaxRecordBytes) {
    self->metrics_.recordRejected();
    log::warn("kv", "{}: dropped a {}-byte record (limit {})", self->options_.name, length, kMaxRecordBytes);
    return UCS_ERR_MESSAGE_TRUNCATED;
  }
  auto pending = std::make_unique<PendingRecv>();
  pending->owner = self;
  pending->data_bytes = framing.data_bytes;
  pending->key = framing.key;
  pending->bytes.resize(length);
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  params.cb.recv_am = &UcxTransport::onRecvDataDone;
  params.user_data = pending.get();
  const auto st = ucp_am_recv_data_nbx(self->worker_.get(), data, pending->bytes.data(), length, &params);
  if (UCS_PTR_IS_ERR(st)) {
    self->metrics_.recordRejected();
    log::warn("kv", "{}: receiving a record: {}", self->options_.name, ucs_status_string(UCS_PTR_STATUS(st)));
    return UCS_OK;
  }
  if (st == nullptr) {
    self->inbox_.push_back(InboxRecord{std::move(pending->bytes), pending->data_bytes, pending->key});
  } else {
    pending->request = ucx::Request(st);
    self->pending_recvs_.push_back(std::move(pending));
  }
  return UCS_INPROGRESS;
}

ucs_status_t UcxTransport::onData(void* arg, const void* header, std::size_t header_length, void* data,
                                  std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    // Our senders always send KV data eagerly; refusing fails the sender's send.
    self->metrics_.addBytesDropped(length);
    return UCS_ERR_UNSUPPORTED;
  }
  if (header_length != sizeof(DataHeader)) {
    self->metrics_.addBytesDropped(length);
    log::warn("kv", "{}: dropped KV data with a {}-byte header", self->options_.name, header_length);
    return UCS_OK;
  }
  DataHeader h{};
  std::memcpy(&h, header, sizeof(h));
  const auto it = self->expectations_.find(h.request_id);
  if (it == self->expectations_.end()) {
    // Expired, cancelled or never expected: its blocks may belong to another request by now.
    self->metrics_.addBytesDropped(length);
    log::debug("kv", "{}: dropped {} bytes of KV data for request {}, which is not expected", self->options_.name,
               length, h.request_id);
    return UCS_OK;
  }
  Expectation& e = it->second;
  if (e.grant && h.key != e.grant->key) {
    // Not from this request's descriptor: a guessed or stale request id. Dropped; the receive
    // goes on (failing it would let anyone who guesses an id end someone else's request).
    self->metrics_.addBytesDropped(length);
    log::warn("kv", "{}: dropped {} bytes of KV data for request {} without its transfer key", self->options_.name,
              length, h.request_id);
    return UCS_OK;
  }
  std::byte* destination = nullptr;
  for (const auto& [id, region] : self->regions_) {
    const auto base = reinterpret_cast<std::uint64_t>(region->base);
    if (h.remote_address >= base && h.remote_address - base <= region->length &&
        length <= region->length - (h.remote_address - base)) {
      destination = region->base + (h.remote_address - base);
      break;
    }
  }
  if (destination == nullptr || (e.grant && !e.grant->covers(h.remote_address, length))) {
    self->metrics_.addBytesDropped(length);
    if (!e.data_error) {
      e.data_error = fmt::format("{} bytes for address 0x{:x} lie outside {}", length, h.remote_address,
                                 destination == nullptr ? "every registered region" : "the blocks the request holds");
    }
    self->data_complete_.insert(h.request_id);
    return UCS_OK;
  }
  std::memcpy(destination, data, length);
  e.bytes_received += length;
  self->metrics_.addBytesReceived(length);
  if (e.held_record && e.bytes_received >= e.record_data_bytes) self->data_complete_.insert(h.request_id);
  return UCS_OK;
}

void UcxTransport::onRecvDataDone(void* /*request*/, ucs_status_t status, std::size_t /*length*/, void* user_data) {
  auto* pending = static_cast<PendingRecv*>(user_data);
  pending->done = true;
  pending->status = status;
  pending->request = ucx::Request{};  // frees the request
}

}  // namespace

Result<KvDataPath> parseKvDataPath(std::string_view text) {
  if (text == "auto") return KvDataPath::Auto;
  if (text == "rma") return KvDataPath::Rma;
  if (text == "am") return KvDataPath::ActiveMessage;
  return makeError(ErrorCode::InvalidArgument,
                   fmt::format("kvtransfer data_path '{}': expected auto, rma or am", text));
}

std::vector<std::pair<std::string, std::string>> ucxSettings(const UcxTransportOptions& options) {
  // Workarounds for UCX 1.13 error paths that abort the process instead of failing the endpoint:
  //  - count an endpoint as connected only once the peer's wireup reply went out; otherwise the
  //    reply of a one-way connection stays pending and the peer's death trips a spurious
  //    assertion (ucp_request_send_state_ff, removed upstream in openucx/ucx#8175);
  //  - on host transports, send with copies instead of tcp zero-copy, whose completion is
  //    counted twice when the peer fails (uct_iface.h "comp->count > 0" assertion), in tcp
  //    segments large enough for one KV data message each.
  std::vector<std::pair<std::string, std::string>> settings = {{"RESOLVE_REMOTE_EP_ID", "on"}};
  if (hostTransportsOnly(options.ucx_tls)) {
    settings.emplace_back("ZCOPY_THRESH", "inf");
    settings.emplace_back("TCP_TX_SEG_SIZE", kTcpSegment);
    settings.emplace_back("TCP_RX_SEG_SIZE", kTcpSegment);
  }
  return settings;
}

std::string_view kvDataPathName(KvDataPath path) {
  switch (path) {
    case KvDataPath::Auto:
      return "auto";
    case KvDataPath::Rma:
      return "rma";
    case KvDataPath::ActiveMessage:
      return "am";
  }
  return "auto";
}

KvDataPath resolveKvDataPath(KvDataPath requested, std::string_view ucx_tls) {
  if (requested != KvDataPath::Auto) return requested;
  return hostTransportsOnly(ucx_tls) ? KvDataPath::ActiveMessage : KvDataPath::Rma;
}

UcxTransportOptions ucxOptionsFromConfig(const KvTransferConfig& config, const CompatInfo& compat) {
  UcxTransportOptions options;
  options.ucx_tls = config.ucx_tls;
  options.compat = compat;
  options.connect_timeout = std::chrono::milliseconds(config.connect_timeout_ms);
  options.peer_suspect_time = std::chrono::milliseconds(config.peer_suspect_ms);
  options.spin_time = std::chrono::microseconds(config.progress_spin_us);
  const auto path = parseKvDataPath(config.data_path);
  PD_CHECK_MSG(path.ok(), "kvtransfer.data_path was validated by its option's choices");
  options.data_path = path.value();
  options.host = config.host;
  return options;
}

Result<std::unique_ptr<Transport>> createUcxTransport(const UcxTransportOptions& options) {
  return UcxTransport::create(options);
}

}  // namespace pd::kvtransfer
