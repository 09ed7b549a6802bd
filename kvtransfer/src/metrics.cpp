#include "pd/kvtransfer/metrics.h"

#include <numeric>
#include <string>
#include <vector>

namespace pd::kvtransfer {
namespace {

constexpr auto kRelaxed = std::memory_order_relaxed;
constexpr std::size_t kSend = 0;
constexpr std::size_t kReceive = 1;
constexpr const char* kSides[] = {"send", "receive"};

double seconds(TransportMetrics::Duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

std::string_view failureCauseName(FailureCause cause) {
  switch (cause) {
    case FailureCause::Timeout:
      return "timeout";
    case FailureCause::PeerFailed:
      return "peer_failed";
    case FailureCause::Cancelled:
      return "cancelled";
    case FailureCause::Rejected:
      return "rejected";
    case FailureCause::Other:
      return "other";
  }
  return "other";
}

FailureCause failureCauseOf(ErrorCode code) {
  switch (code) {
    case ErrorCode::Timeout:
      return FailureCause::Timeout;
    case ErrorCode::PeerFailed:
      return FailureCause::PeerFailed;
    case ErrorCode::Cancelled:
      return FailureCause::Cancelled;
    case ErrorCode::InvalidArgument:
    case ErrorCode::Unsupported:
    case ErrorCode::Corrupt:
    case ErrorCode::Unauthenticated:
      return FailureCause::Rejected;
    default:
      return FailureCause::Other;
  }
}

std::uint64_t TransportStats::transfersFailed() const {
  return std::accumulate(transfers_failed.begin(), transfers_failed.end(), std::uint64_t{0});
}
std::uint64_t TransportStats::receivesFailed() const {
  return std::accumulate(receives_failed.begin(), receives_failed.end(), std::uint64_t{0});
}

TransportMetrics::TransportMetrics(metrics::Registry* registry) {
  if (registry == nullptr) return;
  auto& p = published_;
  p.bytes_put =
      &registry->counter("pdserve_kv_put_bytes_total", "Bytes posted as one-sided puts (once per target).").get();
  p.bytes_received =
      &registry->counter("pdserve_kv_received_bytes_total", "KV bytes accepted as active messages.").get();
  p.bytes_dropped = &registry
                         ->counter("pdserve_kv_dropped_bytes_total",
                                   "KV bytes refused: request not expected, or outside every region.")
                         .get();
  auto& started =
      registry->counter("pdserve_kv_transfers_total", "KV transfers begun (send) or expected (receive).", {"side"});
  auto& succeeded = registry->counter("pdserve_kv_transfers_succeeded_total", "KV transfers completed.", {"side"});
  auto& failed =
      registry->counter("pdserve_kv_transfers_failed_total", "KV transfers failed, by cause.", {"side", "cause"});
  const std::vector<double> bounds(kLatencyBucketBoundsS.begin(), kLatencyBucketBoundsS.end());
  auto& latency =
      registry->histogram("pdserve_kv_transfer_seconds", "Latency of successful KV transfers.", bounds, {"side"});
  for (std::size_t side = 0; side < 2; ++side) {
    p.started[side] = &started.labels({kSides[side]});
    p.succeeded[side] = &succeeded.labels({kSides[side]});
    p.latency[side] = &latency.labels({kSides[side]});
    for (std::size_t c = 0; c < kFailureCauseCount; ++c) {
      p.failed[side][c] = &failed.labels({kSides[side], std::string(failureCauseName(static_cast<FailureCause>(c)))});
    }
  }
  auto& records =
      registry->counter("pdserve_kv_records_total",
                        "Completion and failure records; rejected: malformed, under a transfer id no live grant "
                        "holds, or not signed with the cluster secret; unauthenticated: the last of these; "
                        "trace_dropped: accepted, but its malformed trace context was dropped.",
                        {"event"});
  p.records = {&records.labels({"sent"}), &records.labels({"received"}), &records.labels({"rejected"}),
               &records.labels({"unauthenticated"}), &records.labels({"trace_dropped"})};
  p.in_flight = &registry->gauge("pdserve_kv_in_flight", "KV transfers begun and not yet reported.").get();
  p.pending_receives = &registry->gauge("pdserve_kv_pending_receives", "Expected KV transfers not yet resolved.").get();
  p.regions = &registry->gauge("pdserve_kv_registered_regions", "Memory regions registered for KV transfer.").get();
  p.peers = &registry->gauge("pdserve_kv_peers", "KV transfer peers with an endpoint (connected or connecting).").get();
  p.connecting = &registry
                      ->gauge("pdserve_kv_connecting_peers",
                              "KV transfer peers whose connection handshake (UCX wireup) is still in flight.")
                      .get();
  p.suspect = &registry->gauge("pdserve_kv_suspect_peers", "KV peers refused after a missed deadline.").get();
}

TransportMetrics::~TransportMetrics() {
  add(published_.in_flight, -static_cast<double>(in_flight_.load(kRelaxed)));
  add(published_.pending_receives, -static_cast<double>(pending_receives_.load(kRelaxed)));
  add(published_.regions, -static_cast<double>(regions_.load(kRelaxed)));
  add(published_.peers, -static_cast<double>(peers_.load(kRelaxed)));
  add(published_.connecting, -static_cast<double>(connecting_.load(kRelaxed)));
  add(published_.suspect, -static_cast<double>(suspect_.load(kRelaxed)));
}

void TransportMetrics::AtomicHistogram::observe(Duration latency) {
  const double s = seconds(latency);
  std::size_t bucket = 0;
  while (bucket < kLatencyBucketBoundsS.size() && s > kLatencyBucketBoundsS[bucket]) ++bucket;
  counts[bucket].fetch_add(1, kRelaxed);
  count.fetch_add(1, kRelaxed);
  sum_ns.fetch_add(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(latency).count()),
                   kRelaxed);
}

LatencyHistogram TransportMetrics::AtomicHistogram::snapshot() const {
  LatencyHistogram h;
  for (std::size_t i = 0; i < counts.size(); ++i) h.counts[i] = counts[i].load(kRelaxed);
  h.count = count.load(kRelaxed);
  h.sum_s = static_cast<double>(sum_ns.load(kRelaxed)) * 1e-9;
  return h;
}

void TransportMetrics::addBytesPut(std::uint64_t bytes) {
  bytes_put_.fetch_add(bytes, kRelaxed);
  inc(published_.bytes_put, static_cast<double>(bytes));
}
void TransportMetrics::transferStarted() {
  started_.fetch_add(1, kRelaxed);
  in_flight_.fetch_add(1, kRelaxed);
  inc(published_.started[kSend]);
  add(published_.in_flight, 1);
}
void TransportMetrics::transferSucceeded(Duration latency) {
  succeeded_.fetch_add(1, kRelaxed);
  in_flight_.fetch_sub(1, kRelaxed);
  send_latency_.observe(latency);
  inc(published_.succeeded[kSend]);
  add(published_.in_flight, -1);
  if (published_.latency[kSend] != nullptr) published_.latency[kSend]->observe(seconds(latency));
}
void TransportMetrics::transferFailed(ErrorCode code) {
  const auto cause = static_cast<std::size_t>(failureCauseOf(code));
  failed_[cause].fetch_add(1, kRelaxed);
  in_flight_.fetch_sub(1, kRelaxed);
  inc(published_.failed[kSend][cause]);
  add(published_.in_flight, -1);
}
void TransportMetrics::recordSent() {
  records_sent_.fetch_add(1, kRelaxed);
  inc(published_.records[0]);
}
void TransportMetrics::receiveExpected() {
  expected_.fetch_add(1, kRelaxed);
  pending_receives_.fetch_add(1, kRelaxed);
  inc(published_.started[kReceive]);
  add(published_.pending_receives, 1);
}
void TransportMetrics::receiveSucceeded(Duration latency) {
  received_ok_.fetch_add(1, kRelaxed);
  pending_receives_.fetch_sub(1, kRelaxed);
  receive_latency_.observe(latency);
  inc(published_.succeeded[kReceive]);
  add(published_.pending_receives, -1);
  if (published_.latency[kReceive] != nullptr) published_.latency[kReceive]->observe(seconds(latency));
}
void TransportMetrics::receiveFailed(ErrorCode code) {
  const auto cause = static_cast<std::size_t>(failureCauseOf(code));
  receive_failed_[cause].fetch_add(1, kRelaxed);
  pending_receives_.fetch_sub(1, kRelaxed);
  inc(published_.failed[kReceive][cause]);
  add(published_.pending_receives, -1);
}
void TransportMetrics::recordReceived() {
  records_received_.fetch_add(1, kRelaxed);
  inc(published_.records[1]);
}
void TransportMetrics::recordRejected() {
  records_rejected_.fetch_add(1, kRelaxed);
  inc(published_.records[2]);
}
void TransportMetrics::recordUnauthenticated() {
  records_unauthenticated_.fetch_add(1, kRelaxed);
  inc(published_.records[3]);
}
void TransportMetrics::recordTraceDropped() {
  records_trace_dropped_.fetch_add(1, kRelaxed);
  inc(published_.records[4]);
}
void TransportMetrics::addBytesReceived(std::uint64_t bytes) {
  bytes_received_.fetch_add(bytes, kRelaxed);
  inc(published_.bytes_received, static_cast<double>(bytes));
}
void TransportMetrics::addBytesDropped(std::uint64_t bytes) {
  bytes_dropped_.fetch_add(bytes, kRelaxed);
  inc(published_.bytes_dropped, static_cast<double>(bytes));
}
void TransportMetrics::regionRegistered() {
  regions_.fetch_add(1, kRelaxed);
  add(published_.regions, 1);
}
void TransportMetrics::regionDeregistered() {
  regions_.fetch_sub(1, kRelaxed);
  add(published_.regions, -1);
}
void TransportMetrics::setPeers(std::int64_t peers, std::int64_t connecting, std::int64_t suspect) {
  // Deltas, so that transports sharing a registry add up.
  if (const auto old_peers = peers_.exchange(peers, kRelaxed); old_peers != peers) {
    add(published_.peers, static_cast<double>(peers - old_peers));
  }
  if (const auto old_connecting = connecting_.exchange(connecting, kRelaxed); old_connecting != connecting) {
    add(published_.connecting, static_cast<double>(connecting - old_connecting));
  }
  if (const auto old_suspect = suspect_.exchange(suspect, kRelaxed); old_suspect != suspect) {
    add(published_.suspect, static_cast<double>(suspect - old_suspect));
  }
}

TransportStats TransportMetrics::snapshot() const {
  TransportStats s;
  s.bytes_put = bytes_put_.load(kRelaxed);
  s.transfers_started = started_.load(kRelaxed);
  s.transfers_succeeded = succeeded_.load(kRelaxed);
  for (std::size_t i = 0; i < kFailureCauseCount; ++i) s.transfers_failed[i] = failed_[i].load(kRelaxed);
  s.records_sent = records_sent_.load(kRelaxed);
  s.send_latency = send_latency_.snapshot();
  s.receives_expected = expected_.load(kRelaxed);
  s.receives_succeeded = received_ok_.load(kRelaxed);
  for (std::size_t i = 0; i < kFailureCauseCount; ++i) s.receives_failed[i] = receive_failed_[i].load(kRelaxed);
  s.records_received = records_received_.load(kRelaxed);
  s.records_rejected = records_rejected_.load(kRelaxed);
  s.records_unauthenticated = records_unauthenticated_.load(kRelaxed);
  s.records_trace_dropped = records_trace_dropped_.load(kRelaxed);
  s.bytes_received = bytes_received_.load(kRelaxed);
  s.bytes_dropped = bytes_dropped_.load(kRelaxed);
  s.receive_latency = receive_latency_.snapshot();
  s.in_flight = in_flight_.load(kRelaxed);
  s.pending_receives = pending_receives_.load(kRelaxed);
  s.registered_regions = regions_.load(kRelaxed);
  s.peers = peers_.load(kRelaxed);
  s.connecting_peers = connecting_.load(kRelaxed);
  s.suspect_peers = suspect_.load(kRelaxed);
  return s;
}

}  // namespace pd::kvtransfer
