#pragma once
// UcxTransport's private declaration, shared by the files that implement it by concern:
//  - ucx_transport.cpp: construction, shutdown of the object, registered memory, options;
//  - progress_loop.cpp: the progress thread, commands from other threads, deadlines, teardown;
//  - peers.cpp: endpoints to peers, their remote keys, peer failure and suspicion;
//  - sender.cpp: transfers (prefill side): puts, flushes, records, their outcomes;
//  - receiver.cpp: expectations (decode side): grants, incoming data and records.
//
// Everything that touches UCX runs on the progress thread: public methods called from other
// threads are queued to it and wait for their result (runOnProgressThread). UCX callbacks only
// record what happened (an op finished, a peer failed, a record arrived); the loop then advances
// transfers and calls user callbacks outside any UCX call, so user code never re-enters UCX from
// inside ucp_worker_progress.
//
// Thread rules: see transport.h; every member below is the progress thread's unless it says so.

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "pd/common/crypto.h"
#include "pd/common/internal_auth.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "ucx/ucx_blob_check.h"
#include "ucx/ucx_handles.h"

namespace pd::kvtransfer::detail {

inline constexpr unsigned kRecordAmId = 7;
inline constexpr unsigned kDataAmId = 8;
inline constexpr std::size_t kMaxRecordBytes = 64U << 20;
/// Data path am: KV data messages are at most this long, so that each fits one tcp segment
/// (kTcpSegment below): single-segment sends run 3-5x faster than fragmented ones in UCX 1.13.
inline constexpr std::uint64_t kAmChunkBytes = 112U << 10;
inline constexpr const char* kTcpSegment = "128K";

// Transport framing in active-message headers (docs/kv-transfer.md, "Data paths"); little-endian.
/// Header of a KV data message (data path am): the transfer's wire id (KvDescriptor::
/// transfer_id, hi then lo) and where the bytes go.
struct DataHeader {
  TransferId transfer_id;
  std::uint64_t remote_address;
};
/// Header of a record message: KV bytes the sender delivered to this target as active messages
/// before it (0 for RMA), so that the receiver holds the record until all of them were copied;
/// and the record's tag under the cluster secret (recordTag; all zero when the sender has no
/// secret). The transfer id is the record's own (CompletionRecord::transfer_id).
struct RecordHeader {
  std::uint64_t data_bytes;
  crypto::Digest tag;
};
static_assert(sizeof(DataHeader) == 24 && sizeof(RecordHeader) == 40);

/// The tag a record message carries: InternalAuth::tag("kv-record", data_bytes (u64 LE) ‖ the
/// encoded record), binding the record's contents, its 128-bit transfer id among them, to the
/// data its sender delivered before it. ucx_transport.cpp
[[nodiscard]] crypto::Digest recordTag(const InternalAuth& auth, std::uint64_t data_bytes,
                                       std::span<const std::uint8_t> record);
/// After a deadline force-closed its endpoints, how long a transfer may still wait for UCX to
/// complete its requests before they are released without completion.
inline constexpr auto kForceCloseGrace = std::chrono::seconds(1);
/// Bound on waiting for endpoint close requests at shutdown.
inline constexpr auto kShutdownCloseBound = std::chrono::seconds(1);

/// Every entry of `tls` a host transport, where UCX 1.13 only emulates RMA. ucx_transport.cpp
[[nodiscard]] bool hostTransportsOnly(std::string_view tls);
/// A short name for a peer's (binary) worker address in logs and errors. peers.cpp
[[nodiscard]] std::string peerName(const std::string& key);

inline std::int64_t msUntil(Deadline deadline, Clock::time_point now) {
  return std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
}

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

class UcxTransport final : public Transport {
 public:
  static Result<std::unique_ptr<Transport>> create(const UcxTransportOptions& options);
  ~UcxTransport() override;
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;
  UcxTransport(UcxTransport&&) = delete;
  UcxTransport& operator=(UcxTransport&&) = delete;

  [[nodiscard]] TransportCapabilities capabilities() const override {
    return {fmt::format("ucx({}; {})", options_.ucx_tls, kvDataPathName(data_path_)), true, true,
            context_.registersCudaMemory()};
  }
  [[nodiscard]] const CompatInfo& compat() const override { return options_.compat; }
  Result<RegionId> registerRegion(std::span<std::byte> memory) override;
  Status deregisterRegion(RegionId region) override;
  Result<KvTarget> exportTarget(std::uint32_t tp_rank, std::span<const RegionLayout> layouts) override;
  Status beginTransfer(const KvDescriptor& descriptor, Deadline deadline, TransferDoneFn on_done) override;
  Status put(const TransferId& transfer_id, std::span<const LayerPut> puts) override;
  Status finish(CompletionRecord record) override;
  Status abort(const TransferId& transfer_id, ErrorCode code, std::string reason) override;
  Status expect(std::uint64_t request_id, Deadline deadline, ArrivalFn on_arrival) override;
  bool cancelExpect(std::uint64_t request_id) override;
  Result<KvDescriptor> grant(std::uint64_t request_id, KvDescriptor descriptor) override;
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
    std::set<TransferId> transfers;
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
    TransferId id;
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

  /// What grant() lets a request write: data and records with its wire id; KV data only into
  /// the bytes of its blocks in this transport's regions; a completion record for its token count.
  struct Grant {
    TransferId id;
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
    crypto::Digest tag{};
  };

  /// A rendezvous record being received (ucp_am_recv_data_nbx).
  struct PendingRecv {
    UcxTransport* owner = nullptr;
    std::uint64_t data_bytes = 0;
    crypto::Digest tag{};
    std::vector<std::uint8_t> bytes;
    ucx::Request request;
    bool done = false;
    ucs_status_t status = UCS_OK;
  };

  explicit UcxTransport(const UcxTransportOptions& options, ucx::Context context, ucx::Worker worker,
                        std::vector<std::uint8_t> address, ucx::UcxBlobCheck blob_check, Fd epoll_fd, Fd event_fd);

  // Progress thread (progress_loop.cpp).
  [[nodiscard]] bool onProgressThread() const { return std::this_thread::get_id() == thread_id_.load(); }
  template <class F>
  auto runOnProgressThread(F&& fn) -> std::invoke_result_t<F&>;
  void wake();
  void run();
  bool runCommands();
  void waitForEvents(Clock::time_point now);
  [[nodiscard]] Deadline nextDeadline() const;
  void afterProgress();
  void fireDeadlines(Clock::time_point now);
  void shutdown();
  void drainWorker(Clock::time_point until);
  void updatePeerGauges();
  [[nodiscard]] Status cancelledStatus() const;

  // Peers (peers.cpp).
  Result<Peer*> connect(const std::string& key);
  void failPeer(const std::string& key, const Error& error, bool suspect);
  static void onProbeDone(void* request, ucs_status_t status, void* user_data);
  static void onPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);

  // Sending side (sender.cpp).
  Status post(Transfer& t, ucs_status_ptr_t status, std::string_view what);
  void sendRecord(Transfer& t);
  void flushAll(Transfer& t);
  void advance(Transfer& t);
  void advanceDirty();
  void finalize(const TransferId& id, Status status);
  void failTransfer(Transfer& t, Error error);
  static void onOpDone(void* request, ucs_status_t status, void* user_data);

  // Receiving side (receiver.cpp).
  void handleInbox();
  void deliverRecord(InboxRecord record);
  void deliverHeld();
  // Answers the extracted `expectation` with `error`. If on_arrival re-armed the same request
  // (a prefill retry), the new expectation keeps the old grant and `early` data bytes.
  void failReceive(std::uint64_t id, Expectation expectation, Error error, std::uint64_t early = 0);
  // The granted request that `id` names, or null (counted by the caller): the wire id must be
  // bound by a live grant of this transport.
  [[nodiscard]] std::pair<std::uint64_t, Expectation*> grantedRequest(const TransferId& id);
  // Forgets the wire id of a request whose expectations have all ended.
  void releaseGrantId(const TransferId& id);
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
  std::unordered_map<TransferId, std::unique_ptr<Transfer>, TransferIdHash> transfers_;
  std::unordered_map<std::uint64_t, Expectation> expectations_;  // by the caller's local handle
  // Wire id -> local handle, for every granted request with a live expectation.
  std::unordered_map<TransferId, std::uint64_t, TransferIdHash> granted_ids_;
  std::vector<std::unique_ptr<PendingRecv>> pending_recvs_;

  // Recorded by UCX callbacks, handled by afterProgress().
  std::vector<std::pair<Peer*, ucs_status_t>> failed_peers_;
  std::vector<InboxRecord> inbox_;
  std::set<std::uint64_t> data_complete_;  // held records whose data has now all arrived
  std::set<TransferId> dirty_;
  bool stopping_ = false;

  // Commands from other threads.
  std::mutex mutex_;
  std::deque<std::function<void()>> commands_;
  bool accepting_ = true;
  std::atomic<bool> stop_requested_{false};
  std::atomic<std::thread::id> thread_id_{};
  std::jthread thread_;  // last: started when everything above exists, joined first
};

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

}  // namespace pd::kvtransfer::detail
