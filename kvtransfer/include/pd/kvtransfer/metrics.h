#pragma once
/// KV data-plane metrics: bytes, transfers, failures by cause, latency histograms, and gauges
/// (in-flight transfers, pending receives, registered regions, peers). Every Transport keeps one
/// TransportMetrics; Transport::stats() returns its snapshot, and when given a metrics::Registry
/// it also publishes there (families `pdserve_kv_*`, docs/kv-transfer.md "Metrics"), so a worker's
/// /metrics shows the data plane next to everything else.
///
/// Thread rules: TransportMetrics is thread-safe (relaxed atomics; a snapshot is not one atomic
/// cut across counters). TransportStats is a plain value.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string_view>

#include "pd/common/metrics.h"
#include "pd/common/result.h"

namespace pd::kvtransfer {

enum class FailureCause : std::uint8_t { Timeout, PeerFailed, Cancelled, Rejected, Other };
inline constexpr std::size_t kFailureCauseCount = 5;

/// "timeout", "peer_failed", "cancelled", "rejected", "other".
[[nodiscard]] std::string_view failureCauseName(FailureCause cause);
/// Timeout -> Timeout, PeerFailed -> PeerFailed, Cancelled -> Cancelled, InvalidArgument /
/// Unsupported / Corrupt / Unauthenticated -> Rejected, anything else -> Other.
[[nodiscard]] FailureCause failureCauseOf(ErrorCode code);

/// Upper bounds (seconds) of the latency histogram buckets; one more bucket holds the rest.
inline constexpr std::array<double, 16> kLatencyBucketBoundsS = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};

struct LatencyHistogram {
  std::array<std::uint64_t, kLatencyBucketBoundsS.size() + 1> counts{};  ///< per bucket, not cumulative
  std::uint64_t count = 0;
  double sum_s = 0.0;
};

struct TransportStats {
  // Sending side (prefill).
  std::uint64_t bytes_put = 0;  ///< bytes posted as puts, counted once per target
  std::uint64_t transfers_started = 0;
  std::uint64_t transfers_succeeded = 0;
  std::array<std::uint64_t, kFailureCauseCount> transfers_failed{};  ///< indexed by FailureCause
  std::uint64_t records_sent = 0;
  LatencyHistogram send_latency;  ///< beginTransfer -> success reported
  // Receiving side (decode).
  std::uint64_t receives_expected = 0;
  std::uint64_t receives_succeeded = 0;
  std::array<std::uint64_t, kFailureCauseCount> receives_failed{};
  std::uint64_t records_received = 0;
  std::uint64_t records_rejected = 0;  ///< malformed, under an id no live grant holds, or unsigned
  /// Rejected (also counted there) because the record's HMAC tag is missing or does not verify
  /// under this transport's cluster secret (UcxTransportOptions::auth).
  std::uint64_t records_unauthenticated = 0;
  /// Completion records accepted whose trace context was malformed and dropped (wire.h,
  /// CompletionRecord::traceparent); the record itself was delivered.
  std::uint64_t records_trace_dropped = 0;
  std::uint64_t bytes_received = 0;  ///< KV bytes accepted as active messages (data path am)
  std::uint64_t bytes_dropped = 0;   ///< KV bytes refused: request not expected, or outside every region
  LatencyHistogram receive_latency;  ///< expect -> completion record delivered
  // Gauges.
  std::int64_t in_flight = 0;         ///< transfers begun and not yet reported
  std::int64_t pending_receives = 0;  ///< expects not yet resolved
  std::int64_t registered_regions = 0;
  std::int64_t peers = 0;             ///< cached peers (connected or connecting)
  std::int64_t connecting_peers = 0;  ///< of those, peers whose connection handshake is in flight
  std::int64_t suspect_peers = 0;     ///< peers refused after a missed deadline

  [[nodiscard]] std::uint64_t transfersFailed() const;
  [[nodiscard]] std::uint64_t receivesFailed() const;
};

class TransportMetrics {
 public:
  using Duration = std::chrono::steady_clock::duration;

  /// `registry` (may be null) receives every update too; it must outlive this object. Several
  /// transports may publish to one registry: their series add up.
  explicit TransportMetrics(metrics::Registry* registry = nullptr);
  TransportMetrics(const TransportMetrics&) = delete;
  TransportMetrics& operator=(const TransportMetrics&) = delete;
  TransportMetrics(TransportMetrics&&) = delete;
  TransportMetrics& operator=(TransportMetrics&&) = delete;
  /// Withdraws this object's share of the published gauges (counters stay: they are totals).
  ~TransportMetrics();

  void addBytesPut(std::uint64_t bytes);
  void transferStarted();
  void transferSucceeded(Duration latency);
  void transferFailed(ErrorCode code);
  void recordSent();

  void receiveExpected();
  void receiveSucceeded(Duration latency);
  void receiveFailed(ErrorCode code);
  void recordReceived();
  void recordRejected();
  /// A record refused for its tag; call recordRejected() too.
  void recordUnauthenticated();
  /// A decoded completion record's traceparent was dropped (CompletionRecord::traceparent_dropped).
  void recordTraceDropped();
  void addBytesReceived(std::uint64_t bytes);
  void addBytesDropped(std::uint64_t bytes);

  void regionRegistered();
  void regionDeregistered();
  /// `connecting` counts the peers among `peers` whose handshake has not completed yet.
  void setPeers(std::int64_t peers, std::int64_t connecting, std::int64_t suspect);

  [[nodiscard]] TransportStats snapshot() const;

 private:
  struct AtomicHistogram {
    std::array<std::atomic<std::uint64_t>, kLatencyBucketBoundsS.size() + 1> counts{};
    std::atomic<std::uint64_t> count{0};
    std::atomic<std::uint64_t> sum_ns{0};
    void observe(Duration latency);
    [[nodiscard]] LatencyHistogram snapshot() const;
  };
  /// Children in the registry, looked up once.
  struct Published {
    metrics::Counter* bytes_put = nullptr;
    metrics::Counter* bytes_received = nullptr;
    metrics::Counter* bytes_dropped = nullptr;
    std::array<metrics::Counter*, 2> started{};  // [send, receive]
    std::array<metrics::Counter*, 2> succeeded{};
    std::array<std::array<metrics::Counter*, kFailureCauseCount>, 2> failed{};
    std::array<metrics::Counter*, 5> records{};  // [sent, received, rejected, unauthenticated, trace_dropped]
    std::array<metrics::Histogram*, 2> latency{};
    metrics::Gauge* in_flight = nullptr;
    metrics::Gauge* pending_receives = nullptr;
    metrics::Gauge* regions = nullptr;
    metrics::Gauge* peers = nullptr;
    metrics::Gauge* connecting = nullptr;
    metrics::Gauge* suspect = nullptr;
  };
  static void inc(metrics::Counter* c, double amount = 1.0) {
    if (c != nullptr) c->inc(amount);
  }
  static void add(metrics::Gauge* g, double amount) {
    if (g != nullptr) g->inc(amount);
  }

  Published published_;
  std::atomic<std::uint64_t> bytes_put_{0};
  std::atomic<std::uint64_t> started_{0};
  std::atomic<std::uint64_t> succeeded_{0};
  std::array<std::atomic<std::uint64_t>, kFailureCauseCount> failed_{};
  std::atomic<std::uint64_t> records_sent_{0};
  AtomicHistogram send_latency_;
  std::atomic<std::uint64_t> expected_{0};
  std::atomic<std::uint64_t> received_ok_{0};
  std::array<std::atomic<std::uint64_t>, kFailureCauseCount> receive_failed_{};
  std::atomic<std::uint64_t> records_received_{0};
  std::atomic<std::uint64_t> records_rejected_{0};
  std::atomic<std::uint64_t> records_unauthenticated_{0};
  std::atomic<std::uint64_t> records_trace_dropped_{0};
  std::atomic<std::uint64_t> bytes_received_{0};
  std::atomic<std::uint64_t> bytes_dropped_{0};
  AtomicHistogram receive_latency_;
  std::atomic<std::int64_t> in_flight_{0};
  std::atomic<std::int64_t> pending_receives_{0};
  std::atomic<std::int64_t> regions_{0};
  std::atomic<std::int64_t> peers_{0};
  std::atomic<std::int64_t> connecting_{0};
  std::atomic<std::int64_t> suspect_{0};
};

}  // namespace pd::kvtransfer
