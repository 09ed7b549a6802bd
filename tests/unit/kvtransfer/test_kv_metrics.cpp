// Metrics: counters, gauges, histogram buckets and the Prometheus text.

#include <gtest/gtest.h>

#include "pd/kvtransfer/metrics.h"

namespace pd::kvtransfer {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(KvMetrics, CountsTransfersAndFailuresByCause) {
  TransportMetrics m;
  m.transferStarted();
  m.transferStarted();
  m.transferStarted();
  m.addBytesPut(1000);
  m.transferSucceeded(milliseconds(3));
  m.transferFailed(ErrorCode::Timeout);
  auto s = m.snapshot();
  EXPECT_EQ(s.transfers_started, 3U);
  EXPECT_EQ(s.transfers_succeeded, 1U);
  EXPECT_EQ(s.transfers_failed[static_cast<std::size_t>(FailureCause::Timeout)], 1U);
  EXPECT_EQ(s.in_flight, 1);
  m.transferFailed(ErrorCode::Corrupt);
  s = m.snapshot();
  EXPECT_EQ(s.transfers_failed[static_cast<std::size_t>(FailureCause::Rejected)], 1U);
  EXPECT_EQ(s.transfersFailed(), 2U);
  EXPECT_EQ(s.in_flight, 0);
  EXPECT_EQ(s.bytes_put, 1000U);
}

TEST(KvMetrics, LatencyLandsInTheRightBucket) {
  TransportMetrics m;
  m.receiveExpected();
  m.receiveExpected();
  m.receiveSucceeded(microseconds(50));     // <= 100 us: bucket 0
  m.receiveSucceeded(milliseconds(20000));  // > 10 s: the overflow bucket
  const auto s = m.snapshot();
  EXPECT_EQ(s.receive_latency.counts.front(), 1U);
  EXPECT_EQ(s.receive_latency.counts.back(), 1U);
  EXPECT_EQ(s.receive_latency.count, 2U);
  EXPECT_NEAR(s.receive_latency.sum_s, 20.00005, 1e-6);
  EXPECT_EQ(s.pending_receives, 0);
}

TEST(KvMetrics, PublishesEverySeriesToTheRegistry) {
  metrics::Registry registry;
  {
    TransportMetrics m(&registry);
    m.regionRegistered();
    m.setPeers(2, 1, 1);
    m.transferStarted();
    m.addBytesPut(4096);
    m.transferSucceeded(milliseconds(2));
    m.receiveExpected();
    m.receiveFailed(ErrorCode::PeerFailed);
    m.recordRejected();
  }
  // The first transport is gone: its gauges were withdrawn, its counters stay. A second one adds
  // to the same series.
  TransportMetrics second(&registry);
  second.regionRegistered();
  second.setPeers(1, 0, 0);
  const std::string text = registry.render();
  for (const char* line : {
           "# TYPE pdserve_kv_put_bytes_total counter",
           "pdserve_kv_put_bytes_total 4096",
           "pdserve_kv_transfers_total{side=\"send\"} 1",
           "pdserve_kv_transfers_failed_total{side=\"receive\",cause=\"peer_failed\"} 1",
           "pdserve_kv_transfers_failed_total{side=\"send\",cause=\"timeout\"} 0",
           "pdserve_kv_transfer_seconds_bucket{side=\"send\",le=\"0.001\"} 0",
           "pdserve_kv_transfer_seconds_bucket{side=\"send\",le=\"0.0025\"} 1",
           "pdserve_kv_transfer_seconds_count{side=\"send\"} 1",
           "pdserve_kv_records_total{event=\"rejected\"} 1",
           "pdserve_kv_registered_regions 1",
           "pdserve_kv_peers 1",
           "pdserve_kv_connecting_peers 0",
           "pdserve_kv_suspect_peers 0",
           "pdserve_kv_in_flight 0",
       }) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }
}

}  // namespace
}  // namespace pd::kvtransfer
