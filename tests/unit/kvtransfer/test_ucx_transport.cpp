// UcxTransport in one process: two transports (prefill and decode side) talking over real UCX on
// the loopback interface, for UCX_TLS=tcp and a shared-memory-assisted set, and for both data
// paths (RMA puts, checked active messages). Every test ends with in-flight counts, pending
// receives and registered regions back at zero (TearDown).

#include <gtest/gtest.h>

#include <ostream>
#include <thread>

#include "pd/kvtransfer/ucx_transport.h"
#include "unit/kvtransfer/kv_test_util.h"

namespace pd::kvtransfer {
namespace {

using namespace std::chrono_literals;
using testutil::kHangGuard;
using testutil::KvPool;
using testutil::Outcomes;
using testutil::ScopedRegion;
using testutil::SourceKv;

struct Variant {
  std::string tls;
  KvDataPath path;
};
/// gtest prints the parameter in test names: keep it short and stable.
void PrintTo(const Variant& v, std::ostream* os) {  // NOLINT(readability-identifier-naming): gtest's name
  *os << v.tls << "/" << kvDataPathName(v.path);
}

std::unique_ptr<Transport> makeTransport(const Variant& v, const CompatInfo& compat, const std::string& name,
                                         std::chrono::milliseconds connect_timeout = kHangGuard) {
  UcxTransportOptions options;
  options.ucx_tls = v.tls;
  options.data_path = v.path;
  options.compat = compat;
  options.connect_timeout = connect_timeout;
  options.peer_suspect_time = 5s;
  options.spin_time = 50us;
  options.name = name;
  auto t = createUcxTransport(options);
  EXPECT_TRUE(t.ok()) << t.error().toString();
  return t.ok() ? std::move(t).value() : nullptr;
}

class UcxTransportTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    sender_ = makeTransport(GetParam(), compat_, "prefill");
    receiver_ = makeTransport(GetParam(), compat_, "decode");
    ASSERT_TRUE(sender_ && receiver_);
  }
  void TearDown() override {
    for (const auto* t : {sender_.get(), receiver_.get()}) {
      if (t == nullptr) continue;
      const auto s = t->stats();
      EXPECT_EQ(s.in_flight, 0);
      EXPECT_EQ(s.pending_receives, 0);
      EXPECT_EQ(s.registered_regions, 0);
    }
  }

  Outcomes out_;  // first: outlives the transports that call into it
  CompatInfo compat_ = testutil::realCompat();
  std::unique_ptr<Transport> sender_;
  std::unique_ptr<Transport> receiver_;
};

CompletionRecord sampleRecord(std::uint64_t id, std::uint32_t tokens) {
  CompletionRecord r;
  r.transfer_id = testutil::tid(id);
  r.num_tokens = tokens;
  r.first_token = 12345;
  r.hidden_state.resize(7168);
  for (std::size_t i = 0; i < r.hidden_state.size(); ++i) r.hidden_state[i] = static_cast<float>(i) * 0.25F - 7.0F;
  r.first_logprob = TokenLogprob{12345, -0.125F};
  r.top_logprobs = {{12345, -0.125F}, {7, -2.5F}, {9, -3.0F}};
  return r;
}

// The real layout (61 layers, block size 64, 576 BF16), a prompt that ends mid-block, fragmented
// block ids, chunks that do not align with blocks: every byte lands where the layout says and
// nothing else is touched.
TEST_P(UcxTransportTest, RealLayoutTransfersByteForByte) {
  constexpr std::uint32_t kTokens = 130;
  KvPool pool(*receiver_, compat_, 6);
  ASSERT_TRUE(pool.registered());
  SourceKv source(compat_, kTokens, 11);
  ScopedRegion src(*sender_, source.bytes);
  ASSERT_TRUE(src.ok());
  auto desc = pool.descriptor(1, kTokens, testutil::shuffledBlocks(6, 3, 4), testutil::kHangGuardMs);
  ASSERT_TRUE(desc.ok()) << desc.error().toString();
  // The descriptor travels as bytes, as it would through the router.
  auto wire = decodeKvDescriptor(encode(desc.value()));
  ASSERT_TRUE(wire.ok());

  ASSERT_TRUE(receiver_->expect(1, Clock::now() + kHangGuard, out_.onArrival()).ok());
  ASSERT_TRUE(receiver_->grant(1, wire.value()).ok());
  ASSERT_TRUE(sender_->beginTransfer(wire.value(), Clock::now() + kHangGuard, out_.onDone()).ok());
  for (std::uint32_t first = 0; first < kTokens; first += 48) {
    ASSERT_TRUE(sender_->put(testutil::tid(1), source.chunkPuts(src.id(), first, std::min(48U, kTokens - first))).ok());
  }
  const CompletionRecord sent = sampleRecord(1, kTokens);
  ASSERT_TRUE(sender_->finish(sent).ok());

  const auto done = out_.waitDone(1, kHangGuard);
  ASSERT_TRUE(done.has_value());
  ASSERT_TRUE(done->ok()) << done->error().toString();
  const auto arrived = out_.waitArrival(1, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_TRUE(arrived->ok()) << arrived->error().toString();
  CompletionRecord expected = sent;
  expected.compat_hash = compatHash(compat_);
  EXPECT_EQ(arrived->value(), expected);
  EXPECT_EQ(pool.verify(desc.value(), 11), "");

  const auto s = sender_->stats();
  EXPECT_EQ(s.bytes_put, std::uint64_t{kTokens} * 61 * 1152);
  EXPECT_EQ(s.transfers_succeeded, 1U);
  EXPECT_EQ(s.records_sent, 1U);
  EXPECT_EQ(s.send_latency.count, 1U);
  EXPECT_EQ(s.peers, 1);
  EXPECT_EQ(s.connecting_peers, 0);  // the transfer completed, so the handshake did
  const auto r = receiver_->stats();
  EXPECT_EQ(r.receives_succeeded, 1U);
  EXPECT_EQ(r.records_received, 1U);
  EXPECT_EQ(r.bytes_received, GetParam().path == KvDataPath::ActiveMessage ? s.bytes_put : 0U);
  EXPECT_EQ(r.bytes_dropped, 0U);
}

// With active messages the receiver decides what lands: data of a request whose receive already
// expired (its blocks may belong to another request by now) is dropped, not written.
TEST_P(UcxTransportTest, DataOfAnExpiredReceiveIsDropped) {
  if (GetParam().path == KvDataPath::Rma) {
    GTEST_SKIP() << "one-sided puts land whatever the receiver expects; receive_grace_ms covers that path";
  }
  compat_ = testutil::smallCompat();
  sender_ = makeTransport(GetParam(), compat_, "prefill");
  receiver_ = makeTransport(GetParam(), compat_, "decode");
  KvPool pool(*receiver_, compat_, 8);
  SourceKv source(compat_, 6, 1);
  ScopedRegion src(*sender_, source.bytes);
  auto d = pool.descriptor(13, 6, {4, 1}, testutil::kHangGuardMs);
  ASSERT_TRUE(receiver_->expect(13, Clock::now() + 50ms, out_.onArrival()).ok());
  ASSERT_TRUE(receiver_->grant(13, d.value()).ok());
  const auto expired = out_.waitArrival(13, kHangGuard);
  ASSERT_TRUE(expired.has_value());
  EXPECT_EQ(expired->error().code, ErrorCode::Timeout);

  ASSERT_TRUE(sender_->beginTransfer(d.value(), Clock::now() + kHangGuard, out_.onDone()).ok());
  ASSERT_TRUE(sender_->put(testutil::tid(13), source.chunkPuts(src.id(), 0, 6)).ok());
  CompletionRecord r;
  r.transfer_id = testutil::tid(13);
  ASSERT_TRUE(sender_->finish(r).ok());
  const auto done = out_.waitDone(13, kHangGuard);
  ASSERT_TRUE(done && done->ok());
  // The record left the sender; the receiver handles it on its own thread.
  const auto settled = [&] {
    const auto st = receiver_->stats();
    return st.records_rejected == 1 && st.bytes_dropped == 3ULL * 6 * 16;
  };
  ASSERT_TRUE(testutil::eventually(settled)) << "the receiver never settled the expired request's data";
  const auto stats = receiver_->stats();
  EXPECT_EQ(stats.bytes_dropped, 3U * 6 * 16);
  EXPECT_EQ(stats.bytes_received, 0U);
  EXPECT_EQ(stats.records_rejected, 1U);
  KvDescriptor nothing = d.value();
  nothing.num_tokens = 0;  // verify: no token expected, every block untouched
  EXPECT_EQ(pool.verify(nothing, 1), "");
}

constexpr const char* kTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

TEST_P(UcxTransportTest, ConcurrentSmallTransfersAllLand) {
  compat_ = testutil::smallCompat();
  sender_ = makeTransport(GetParam(), compat_, "prefill");
  receiver_ = makeTransport(GetParam(), compat_, "decode");
  KvPool pool(*receiver_, compat_, 32);
  constexpr int kRequests = 8;
  std::vector<std::unique_ptr<SourceKv>> sources;
  std::vector<std::unique_ptr<ScopedRegion>> regions;
  std::vector<KvDescriptor> descs;
  const auto blocks = testutil::shuffledBlocks(32, 2 * kRequests, 99);
  for (int i = 0; i < kRequests; ++i) {
    const auto id = 100U + static_cast<std::uint64_t>(i);
    sources.push_back(std::make_unique<SourceKv>(compat_, 7, id));
    regions.push_back(std::make_unique<ScopedRegion>(*sender_, sources.back()->bytes));
    const auto first = static_cast<std::size_t>(i) * 2;
    auto d = pool.descriptor(id, 7, {blocks[first], blocks[first + 1]}, testutil::kHangGuardMs);
    ASSERT_TRUE(d.ok());
    descs.push_back(d.value());
    ASSERT_TRUE(receiver_->expect(id, Clock::now() + kHangGuard, out_.onArrival()).ok());
    ASSERT_TRUE(receiver_->grant(id, descs.back()).ok());
    ASSERT_TRUE(sender_->beginTransfer(descs.back(), Clock::now() + kHangGuard, out_.onDone()).ok());
  }
  // Interleave: first halves of every request, then second halves, then the records.
  for (int i = 0; i < kRequests; ++i)
    ASSERT_TRUE(sender_->put(descs[i].transfer_id, sources[i]->chunkPuts(regions[i]->id(), 0, 3)).ok());
  for (int i = 0; i < kRequests; ++i)
    ASSERT_TRUE(sender_->put(descs[i].transfer_id, sources[i]->chunkPuts(regions[i]->id(), 3, 4)).ok());
  for (int i = 0; i < kRequests; ++i) {
    CompletionRecord r;
    r.transfer_id = descs[i].transfer_id;
    r.num_tokens = 7;
    r.first_token = i;
    // The trace context travels with the record; a malformed one is dropped and counted at the
    // receiver, and its record lands all the same.
    if (i % 2 == 0) r.traceparent = kTraceparent;
    if (i % 4 == 1) r.traceparent = "00-NOT-A-TRACEPARENT";
    ASSERT_TRUE(sender_->finish(r).ok());
  }
  for (int i = 0; i < kRequests; ++i) {
    const auto id = descs[i].transfer_id.lo;
    const auto done = out_.waitDone(id, kHangGuard);
    ASSERT_TRUE(done && done->ok());
    const auto arrived = out_.waitArrival(id, kHangGuard);
    ASSERT_TRUE(arrived && arrived->ok());
    EXPECT_EQ(arrived->value().first_token, i);
    EXPECT_EQ(arrived->value().traceparent, i % 2 == 0 ? kTraceparent : "");
    EXPECT_EQ(arrived->value().traceparent_dropped, i % 4 == 1);
    EXPECT_EQ(pool.verify(descs[i], id).find("differs"), std::string::npos) << pool.verify(descs[i], id);
  }
  EXPECT_EQ(out_.doneCalls(), kRequests);
  EXPECT_EQ(out_.arrivalCalls(), kRequests);
  EXPECT_EQ(receiver_->stats().records_trace_dropped, static_cast<std::uint64_t>(kRequests / 4));
  EXPECT_EQ(receiver_->stats().records_rejected, 0U);
}

TEST_P(UcxTransportTest, CompatibilityMismatchIsAClearErrorAtBegin) {
  auto other = makeTransport(GetParam(), testutil::realCompat(0xbad), "decode-other");
  KvPool pool(*other, testutil::realCompat(0xbad), 2);
  auto desc = pool.descriptor(2, 10, {0}, 1000);
  ASSERT_TRUE(desc.ok());
  const Status s = sender_->beginTransfer(desc.value(), Clock::now() + 1s, out_.onDone());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::Unsupported);
  EXPECT_NE(s.error().message.find("model_hash"), std::string::npos) << s.error().message;
  EXPECT_EQ(sender_->stats().transfers_started, 0U);
}

TEST_P(UcxTransportTest, ReceiveDeadlineFiresOnTheTimer) {
  const auto start = Clock::now();
  ASSERT_TRUE(receiver_->expect(3, start + 150ms, out_.onArrival()).ok());
  const auto arrived = out_.waitArrival(3, kHangGuard);
  const auto elapsed = Clock::now() - start;
  ASSERT_TRUE(arrived.has_value());
  ASSERT_FALSE(arrived->ok());
  EXPECT_EQ(arrived->error().code, ErrorCode::Timeout);
  EXPECT_GE(elapsed, 150ms);
  EXPECT_LT(elapsed, 2s);
  EXPECT_EQ(receiver_->stats().receives_failed[static_cast<std::size_t>(FailureCause::Timeout)], 1U);
}

// A sender that never finishes (its prefill stalled before its first layer) times out; with no
// put outstanding the network is not to blame, so the peer is not condemned and the next transfer
// to it works. No put is posted: whether a posted put completes within a short deadline depends
// on the machine's load, and only the outstanding puts decide the peer's fate.
TEST_P(UcxTransportTest, UnfinishedTransferTimesOutWithoutCondemningThePeer) {
  compat_ = testutil::smallCompat();
  sender_ = makeTransport(GetParam(), compat_, "prefill");
  receiver_ = makeTransport(GetParam(), compat_, "decode");
  KvPool pool(*receiver_, compat_, 8);
  SourceKv source(compat_, 4, 1);
  ScopedRegion src(*sender_, source.bytes);
  auto d4 = pool.descriptor(4, 4, {1}, testutil::kHangGuardMs);
  ASSERT_TRUE(sender_->beginTransfer(d4.value(), Clock::now() + 200ms, out_.onDone()).ok());
  const auto done = out_.waitDone(4, kHangGuard);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->error().code, ErrorCode::Timeout);
  EXPECT_EQ(sender_->stats().suspect_peers, 0);

  auto d5 = pool.descriptor(5, 4, {2}, testutil::kHangGuardMs);
  ASSERT_TRUE(receiver_->expect(5, Clock::now() + kHangGuard, out_.onArrival()).ok());
  ASSERT_TRUE(receiver_->grant(5, d5.value()).ok());
  ASSERT_TRUE(sender_->beginTransfer(d5.value(), Clock::now() + kHangGuard, out_.onDone()).ok());
  ASSERT_TRUE(sender_->put(testutil::tid(5), source.chunkPuts(src.id(), 0, 4)).ok());
  CompletionRecord r;
  r.transfer_id = testutil::tid(5);
  r.num_tokens = 4;
  ASSERT_TRUE(sender_->finish(r).ok());
  const auto ok = out_.waitDone(5, kHangGuard);
  ASSERT_TRUE(ok && ok->ok());
  const auto arrived5 = out_.waitArrival(5, kHangGuard);
  ASSERT_TRUE(arrived5.has_value());
  EXPECT_TRUE(arrived5->ok()) << arrived5->error().toString();
}

TEST_P(UcxTransportTest, AbortDeliversTheFailureToTheReceiver) {
  compat_ = testutil::smallCompat();
  sender_ = makeTransport(GetParam(), compat_, "prefill");
  receiver_ = makeTransport(GetParam(), compat_, "decode");
  KvPool pool(*receiver_, compat_, 8);
  SourceKv source(compat_, 4, 1);
  ScopedRegion src(*sender_, source.bytes);
  auto d = pool.descriptor(6, 4, {3}, testutil::kHangGuardMs);
  ASSERT_TRUE(receiver_->expect(6, Clock::now() + kHangGuard, out_.onArrival()).ok());
  ASSERT_TRUE(receiver_->grant(6, d.value()).ok());
  ASSERT_TRUE(sender_->beginTransfer(d.value(), Clock::now() + kHangGuard, out_.onDone()).ok());
  ASSERT_TRUE(sender_->put(testutil::tid(6), source.chunkPuts(src.id(), 0, 4)).ok());
  ASSERT_TRUE(sender_->abort(testutil::tid(6), ErrorCode::Overloaded, "prefill queue full").ok());
  const auto done = out_.waitDone(6, kHangGuard);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->error().code, ErrorCode::Cancelled);
  const auto arrived = out_.waitArrival(6, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_FALSE(arrived->ok());
  EXPECT_EQ(arrived->error().code, ErrorCode::Overloaded);
  EXPECT_NE(arrived->error().message.find("prefill queue full"), std::string::npos);
}

// The receiving process's transport disappears while puts are posted: the sender hears about it
// from UCX (PeerFailed), well before the deadline.
TEST_P(UcxTransportTest, ReceiverGoneMidTransferIsReportedAsPeerFailure) {
  std::vector<std::byte> pool_memory(64U << 20);
  auto region = receiver_->registerRegion(pool_memory);
  ASSERT_TRUE(region.ok());
  const std::uint64_t block = 64ULL * 1152;
  const RegionLayout layout{region.value(), 0, 0, 61, 8 * block, block};
  auto target = receiver_->exportTarget(0, std::span(&layout, 1));
  ASSERT_TRUE(target.ok());
  KvDescriptor d{testutil::tid(7), compat_, 512, 30000, {0, 1, 2, 3, 4, 5, 6, 7}, {target.value()}};
  SourceKv source(compat_, 512, 3);
  ScopedRegion src(*sender_, source.bytes);
  ASSERT_TRUE(sender_->beginTransfer(d, Clock::now() + 30s, out_.onDone()).ok());
  ASSERT_TRUE(sender_->put(testutil::tid(7), source.chunkPuts(src.id(), 0, 512)).ok());
  const auto start = Clock::now();
  receiver_.reset();  // its worker and sockets go away (the region warning is expected)
  (void)sender_->finish(sampleRecord(7, 512));
  const auto done = out_.waitDone(7, 20s);
  ASSERT_TRUE(done.has_value());
  ASSERT_FALSE(done->ok());
  EXPECT_EQ(done->error().code, ErrorCode::PeerFailed) << done->error().toString();
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_EQ(sender_->stats().peers, 0);
}

TEST_P(UcxTransportTest, UnreachablePeerFailsWithinTheConnectTimeout) {
  KvDescriptor d;
  {
    auto gone = makeTransport(GetParam(), compat_, "gone");
    KvPool pool(*gone, compat_, 2);
    d = pool.descriptor(8, 10, {1}, 30000).value();
  }
  sender_ = makeTransport(GetParam(), compat_, "prefill", 2s);  // the timeout under test
  ASSERT_TRUE(sender_);
  const auto start = Clock::now();
  const Status begun = sender_->beginTransfer(d, Clock::now() + 30s, out_.onDone());
  if (begun.ok()) {
    const auto done = out_.waitDone(8, kHangGuard);
    ASSERT_TRUE(done.has_value());
    ASSERT_FALSE(done->ok());
    EXPECT_EQ(done->error().code, ErrorCode::PeerFailed) << done->error().toString();
  } else {
    EXPECT_EQ(begun.error().code, ErrorCode::PeerFailed) << begun.error().toString();
  }
  EXPECT_LT(Clock::now() - start, 3s);
}

TEST_P(UcxTransportTest, MisuseIsReportedAsErrors) {
  UcxTransportOptions shm_only;
  shm_only.ucx_tls = "sm";
  const auto refused = createUcxTransport(shm_only);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ErrorCode::InvalidArgument);
  EXPECT_NE(refused.error().message.find("tcp"), std::string::npos);

  EXPECT_EQ(sender_->put(testutil::tid(404), {}).error().code, ErrorCode::NotFound);
  EXPECT_EQ(sender_->finish(CompletionRecord{}).error().code, ErrorCode::NotFound);
  EXPECT_EQ(sender_->abort(testutil::tid(404), ErrorCode::Internal, "x").error().code, ErrorCode::NotFound);
  EXPECT_EQ(sender_->deregisterRegion(404).error().code, ErrorCode::NotFound);

  KvPool pool(*receiver_, compat_, 2);
  SourceKv source(compat_, 10, 1);
  ScopedRegion src(*sender_, source.bytes);
  auto d = pool.descriptor(9, 10, {1}, testutil::kHangGuardMs);
  KvDescriptor ungranted = d.value();
  ungranted.transfer_id = TransferId{};  // a descriptor no decode transport granted
  EXPECT_EQ(sender_->beginTransfer(ungranted, Clock::now() + kHangGuard, out_.onDone()).error().code,
            ErrorCode::InvalidArgument);
  EXPECT_EQ(receiver_->grant(9, d.value()).error().code, ErrorCode::NotFound);  // not expected
  ASSERT_TRUE(sender_->beginTransfer(d.value(), Clock::now() + kHangGuard, out_.onDone()).ok());
  EXPECT_EQ(sender_->beginTransfer(d.value(), Clock::now() + kHangGuard, out_.onDone()).error().code,
            ErrorCode::InvalidArgument);
  EXPECT_EQ(sender_->put(testutil::tid(9), source.chunkPuts(src.id(), 5, 6)).error().code,
            ErrorCode::InvalidArgument);  // > 10
  const LayerPut past_local{LayerSlice{0, 0, 10}, src.id(), source.bytes.size() - 100};
  EXPECT_EQ(sender_->put(testutil::tid(9), std::span(&past_local, 1)).error().code, ErrorCode::InvalidArgument);
  ASSERT_TRUE(sender_->put(testutil::tid(9), source.chunkPuts(src.id(), 0, 10)).ok());
  EXPECT_EQ(sender_->deregisterRegion(src.id()).error().code, ErrorCode::InvalidArgument);  // in use
  ASSERT_TRUE(sender_->abort(testutil::tid(9), ErrorCode::Cancelled, "test over").ok());
  ASSERT_TRUE(out_.waitDone(9, kHangGuard).has_value());

  ASSERT_TRUE(receiver_->expect(10, Clock::now() + kHangGuard, out_.onArrival()).ok());
  EXPECT_EQ(receiver_->expect(10, Clock::now() + kHangGuard, out_.onArrival()).error().code,
            ErrorCode::InvalidArgument);
  EXPECT_TRUE(receiver_->cancelExpect(10));
  EXPECT_FALSE(receiver_->cancelExpect(10));
  const auto cancelled = out_.waitArrival(10, 1s);
  ASSERT_TRUE(cancelled.has_value());
  EXPECT_EQ(cancelled->error().code, ErrorCode::Cancelled);
}

TEST_P(UcxTransportTest, DestroyingTheTransportAnswersEverythingPending) {
  ASSERT_TRUE(receiver_->expect(11, Clock::now() + 60s, out_.onArrival()).ok());
  KvPool pool(*receiver_, compat_, 2);
  auto d = pool.descriptor(12, 10, {1}, 60000);
  ASSERT_TRUE(sender_->beginTransfer(d.value(), Clock::now() + 60s, out_.onDone()).ok());
  sender_.reset();
  const auto done = out_.waitDone(12, 1s);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->error().code, ErrorCode::Cancelled);
  EXPECT_TRUE(receiver_->cancelExpect(11));
}

INSTANTIATE_TEST_SUITE_P(Ucx, UcxTransportTest,
                         ::testing::Values(Variant{"tcp", KvDataPath::ActiveMessage}, Variant{"tcp", KvDataPath::Rma},
                                           Variant{"tcp,sm", KvDataPath::ActiveMessage},
                                           Variant{"tcp,sm", KvDataPath::Rma}),
                         [](const ::testing::TestParamInfo<Variant>& v) {
                           return std::string(v.param.tls == "tcp" ? "tcp" : "tcp_sm") +
                                  (v.param.path == KvDataPath::Rma ? "_rma" : "_am");
                         });

}  // namespace
}  // namespace pd::kvtransfer

namespace pd::kvtransfer {
namespace {

TEST(UcxDataPath, AutoPicksActiveMessagesOnHostTransportsOnly) {
  EXPECT_EQ(resolveKvDataPath(KvDataPath::Auto, "tcp"), KvDataPath::ActiveMessage);
  EXPECT_EQ(resolveKvDataPath(KvDataPath::Auto, "tcp,sm"), KvDataPath::ActiveMessage);
  EXPECT_EQ(resolveKvDataPath(KvDataPath::Auto, "tcp,cma,self"), KvDataPath::ActiveMessage);
  EXPECT_EQ(resolveKvDataPath(KvDataPath::Auto, "rc,tcp"), KvDataPath::Rma);
  EXPECT_EQ(resolveKvDataPath(KvDataPath::Auto, "all"), KvDataPath::Rma);
  EXPECT_EQ(resolveKvDataPath(KvDataPath::Auto, "^ud"), KvDataPath::Rma);
  EXPECT_EQ(resolveKvDataPath(KvDataPath::Rma, "tcp"), KvDataPath::Rma);
  EXPECT_EQ(parseKvDataPath("am").value(), KvDataPath::ActiveMessage);
  EXPECT_EQ(parseKvDataPath("bogus").error().code, ErrorCode::InvalidArgument);
}

}  // namespace
}  // namespace pd::kvtransfer
