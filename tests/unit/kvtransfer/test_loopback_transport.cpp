// The loopback fake keeps the Transport contract, so prefill/decode tests built on it mean
// something: bytes land where the layout says, every transfer and receive is answered once, and
// faults end in the documented errors.

#include <gtest/gtest.h>

#include "fakes/loopback_transport.h"
#include "unit/kvtransfer/kv_test_util.h"

namespace pd::kvtransfer {
namespace {

using fakes::LoopbackFabric;
using fakes::LoopbackTransport;
using testutil::KvPool;
using testutil::SourceKv;

struct Outcomes {
  std::vector<std::pair<std::uint64_t, Status>> done;
  std::vector<std::pair<std::uint64_t, Result<CompletionRecord>>> arrived;
  TransferDoneFn onDone() {
    return [this](const TransferId& id, Status s) { done.emplace_back(id.lo, std::move(s)); };  // tid(n).lo == n
  }
  ArrivalFn onArrival() {
    return [this](std::uint64_t id, Result<CompletionRecord> r) { arrived.emplace_back(id, std::move(r)); };
  }
};

class LoopbackTest : public ::testing::Test {
 protected:
  Outcomes out_;  // first: the transports answer into it when destroyed
  std::shared_ptr<LoopbackFabric> fabric_ = std::make_shared<LoopbackFabric>();
  CompatInfo compat_ = testutil::smallCompat();
  LoopbackTransport prefill_{fabric_, compat_};
  LoopbackTransport decode_{fabric_, compat_};
};

TEST_F(LoopbackTest, CopiesBytesWhereTheLayoutSaysAndDeliversTheRecord) {
  KvPool pool(decode_, compat_, 8);
  SourceKv source(compat_, 10, 5);
  auto src_region = prefill_.registerRegion(source.bytes);
  ASSERT_TRUE(src_region.ok());
  auto desc = pool.descriptor(1, 10, {6, 0, 3}, 1000);
  ASSERT_TRUE(desc.ok());
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  ASSERT_TRUE(decode_.expect(1, deadline, out_.onArrival()).ok());
  ASSERT_TRUE(decode_.grant(1, desc.value()).ok());
  ASSERT_TRUE(prefill_.beginTransfer(desc.value(), deadline, out_.onDone()).ok());
  ASSERT_TRUE(prefill_.put(testutil::tid(1), source.chunkPuts(src_region.value(), 0, 6)).ok());
  ASSERT_TRUE(prefill_.put(testutil::tid(1), source.chunkPuts(src_region.value(), 6, 4)).ok());
  CompletionRecord rec;
  rec.transfer_id = testutil::tid(1);
  rec.first_token = 77;
  rec.hidden_state = {1.5F, -2.0F};
  ASSERT_TRUE(prefill_.finish(rec).ok());

  ASSERT_EQ(out_.done.size(), 1U);
  EXPECT_TRUE(out_.done[0].second.ok());
  ASSERT_EQ(out_.arrived.size(), 1U);
  ASSERT_TRUE(out_.arrived[0].second.ok());
  EXPECT_EQ(out_.arrived[0].second.value().first_token, 77);
  EXPECT_EQ(out_.arrived[0].second.value().hidden_state, rec.hidden_state);
  EXPECT_EQ(pool.verify(desc.value(), 5), "");
  EXPECT_EQ(prefill_.stats().bytes_put, 3U * 10 * 16);
  EXPECT_TRUE(prefill_.deregisterRegion(src_region.value()).ok());
}

TEST_F(LoopbackTest, PeerDownFailsTheTransferAtOnce) {
  KvPool pool(decode_, compat_, 8);
  auto desc = pool.descriptor(2, 4, {1}, 1000);
  ASSERT_TRUE(prefill_.beginTransfer(desc.value(), Clock::now() + std::chrono::seconds(1), out_.onDone()).ok());
  fabric_->setPeerDown(decode_.address(), true);
  ASSERT_EQ(out_.done.size(), 1U);
  EXPECT_EQ(out_.done[0].second.error().code, ErrorCode::PeerFailed);
  EXPECT_EQ(prefill_.stats().in_flight, 0);
  EXPECT_EQ(prefill_.beginTransfer(desc.value(), Clock::now(), out_.onDone()).error().code, ErrorCode::PeerFailed);
}

TEST_F(LoopbackTest, SilentPeerEndsByDeadlineOnBothSides) {
  KvPool pool(decode_, compat_, 8);
  auto desc = pool.descriptor(3, 4, {1}, 1000);
  const auto deadline = Clock::now() + std::chrono::milliseconds(100);
  ASSERT_TRUE(decode_.expect(3, deadline, out_.onArrival()).ok());
  ASSERT_TRUE(decode_.grant(3, desc.value()).ok());
  ASSERT_TRUE(prefill_.beginTransfer(desc.value(), deadline, out_.onDone()).ok());
  fabric_->setSilent(decode_.address(), true);
  CompletionRecord rec;
  rec.transfer_id = testutil::tid(3);
  ASSERT_TRUE(prefill_.finish(rec).ok());
  EXPECT_TRUE(out_.done.empty());
  prefill_.expireDeadlines(deadline);
  decode_.expireDeadlines(deadline);
  ASSERT_EQ(out_.done.size(), 1U);
  EXPECT_EQ(out_.done[0].second.error().code, ErrorCode::Timeout);
  ASSERT_EQ(out_.arrived.size(), 1U);
  EXPECT_EQ(out_.arrived[0].second.error().code, ErrorCode::Timeout);
  EXPECT_EQ(decode_.stats().pending_receives, 0);
}

TEST_F(LoopbackTest, AbortReachesTheReceiverAsItsError) {
  KvPool pool(decode_, compat_, 8);
  auto desc = pool.descriptor(4, 4, {1}, 1000);
  ASSERT_TRUE(decode_.expect(4, Clock::now() + std::chrono::seconds(1), out_.onArrival()).ok());
  ASSERT_TRUE(decode_.grant(4, desc.value()).ok());
  ASSERT_TRUE(prefill_.beginTransfer(desc.value(), Clock::now() + std::chrono::seconds(1), out_.onDone()).ok());
  ASSERT_TRUE(prefill_.abort(testutil::tid(4), ErrorCode::Overloaded, "prefill queue full").ok());
  ASSERT_EQ(out_.done.size(), 1U);
  EXPECT_EQ(out_.done[0].second.error().code, ErrorCode::Cancelled);
  ASSERT_EQ(out_.arrived.size(), 1U);
  EXPECT_EQ(out_.arrived[0].second.error().code, ErrorCode::Overloaded);
  EXPECT_NE(out_.arrived[0].second.error().message.find("prefill queue full"), std::string::npos);
}

// Records are looked up by the granted wire id only: one under an id no grant bound (a guessed
// one, or the request's id before its grant) is dropped and counted, and the receive goes on.
TEST_F(LoopbackTest, RecordsUnderAnUnboundIdAreDroppedAndCounted) {
  KvPool pool(decode_, compat_, 8);
  ASSERT_TRUE(decode_.expect(7, Clock::now() + std::chrono::seconds(1), out_.onArrival()).ok());
  KvDescriptor d = pool.descriptor(7, 4, {1}, 1000).value();
  d.transfer_id = TransferId{};
  auto granted = decode_.grant(7, d);
  ASSERT_TRUE(granted.ok());
  ASSERT_FALSE(granted->transfer_id.empty());
  KvDescriptor guessed = granted.value();
  guessed.transfer_id.lo ^= 1;
  ASSERT_TRUE(prefill_.beginTransfer(guessed, Clock::now() + std::chrono::seconds(1), out_.onDone()).ok());
  CompletionRecord rec;
  rec.transfer_id = guessed.transfer_id;
  rec.num_tokens = 4;
  ASSERT_TRUE(prefill_.finish(rec).ok());
  EXPECT_TRUE(out_.arrived.empty()) << "a record under a guessed id ended the receive";
  EXPECT_EQ(decode_.stats().records_rejected, 1U);
  ASSERT_TRUE(prefill_.beginTransfer(granted.value(), Clock::now() + std::chrono::seconds(1), out_.onDone()).ok());
  rec.transfer_id = granted->transfer_id;
  ASSERT_TRUE(prefill_.finish(rec).ok());
  ASSERT_EQ(out_.arrived.size(), 1U);
  EXPECT_TRUE(out_.arrived[0].second.ok());
  EXPECT_EQ(out_.arrived[0].first, 7U);
}

TEST_F(LoopbackTest, CompatMismatchIsRefusedAtBegin) {
  LoopbackTransport other{fabric_, testutil::smallCompat(0xbad)};
  KvPool pool(other, testutil::smallCompat(0xbad), 8);
  auto desc = pool.descriptor(5, 4, {1}, 1000);
  const Status s = prefill_.beginTransfer(desc.value(), Clock::now() + std::chrono::seconds(1), out_.onDone());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::Unsupported);
  EXPECT_NE(s.error().message.find("model_hash"), std::string::npos);
  EXPECT_TRUE(out_.done.empty());
}

TEST_F(LoopbackTest, DestroyingAnswersWhatIsPending) {
  {
    LoopbackTransport temp{fabric_, compat_};
    ASSERT_TRUE(temp.expect(6, Clock::now() + std::chrono::seconds(10), out_.onArrival()).ok());
  }
  ASSERT_EQ(out_.arrived.size(), 1U);
  EXPECT_EQ(out_.arrived[0].second.error().code, ErrorCode::Cancelled);
}

}  // namespace
}  // namespace pd::kvtransfer
