// Write confinement on the receiving side of UcxTransport: grant() binds a request to a fresh
// 128-bit random transfer id, the only id data and records are looked up by (a guessed, stale or
// ungranted one is dropped and counted); a request's KV data may land only in the blocks its
// descriptor lists; a completion record must be for the granted token count; and with a cluster
// secret every record must carry its HMAC tag. Also: a transport given a loopback `host` listens
// on the loopback interface only.

#include <dirent.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "pd/common/internal_auth.h"
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
using testutil::tid;

/// A descriptor as the decode worker builds it before its grant: no transfer id yet.
KvDescriptor ungranted(const KvPool& pool, std::uint64_t request, std::uint32_t tokens,
                       std::vector<std::uint32_t> blocks) {
  KvDescriptor d = pool.descriptor(request, tokens, std::move(blocks), testutil::kHangGuardMs).value();
  d.transfer_id = TransferId{};
  return d;
}

std::unique_ptr<Transport> makeTransport(KvDataPath path, const CompatInfo& compat, const std::string& name,
                                         const std::string& host = "",
                                         std::shared_ptr<const InternalAuth> auth = nullptr) {
  UcxTransportOptions options;
  options.auth = std::move(auth);
  options.ucx_tls = "tcp";
  options.data_path = path;
  options.compat = compat;
  options.connect_timeout = kHangGuard;
  options.spin_time = 50us;
  options.name = name;
  options.host = host;
  auto t = createUcxTransport(options);
  EXPECT_TRUE(t.ok()) << t.error().toString();
  return t.ok() ? std::move(t).value() : nullptr;
}

class WriteConfinement : public ::testing::TestWithParam<KvDataPath> {
 protected:
  void SetUp() override {
    sender_ = makeTransport(GetParam(), compat_, "prefill");
    receiver_ = makeTransport(GetParam(), compat_, "decode");
    ASSERT_TRUE(sender_ && receiver_);
  }
  void TearDown() override {
    for (const auto* t : {sender_.get(), receiver_.get()}) {
      const auto s = t->stats();
      EXPECT_EQ(s.in_flight, 0);
      EXPECT_EQ(s.pending_receives, 0);
    }
  }
  /// Sends `d` (tokens [0, n) of a seeded source) with a record for `record_tokens` tokens; the
  /// sender's outcome goes to `sent` (default: out_).
  void send(const KvDescriptor& d, std::uint32_t record_tokens, Outcomes* sent = nullptr) {
    Outcomes& done_to = sent != nullptr ? *sent : out_;
    SourceKv source(compat_, d.num_tokens, 5);
    ScopedRegion src(*sender_, source.bytes);
    ASSERT_TRUE(src.ok());
    ASSERT_TRUE(sender_->beginTransfer(d, Clock::now() + kHangGuard, done_to.onDone()).ok());
    ASSERT_TRUE(sender_->put(d.transfer_id, source.chunkPuts(src.id(), 0, d.num_tokens)).ok());
    CompletionRecord r;
    r.transfer_id = d.transfer_id;
    r.num_tokens = record_tokens;
    ASSERT_TRUE(sender_->finish(r).ok());
    const auto done = done_to.waitDone(d.transfer_id.lo, kHangGuard);  // Outcomes keys by the low half
    ASSERT_TRUE(done.has_value());
  }

  Outcomes out_;
  CompatInfo compat_ = testutil::smallCompat();
  std::unique_ptr<Transport> sender_;
  std::unique_ptr<Transport> receiver_;
};

TEST_P(WriteConfinement, GrantedTransferLandsUnderAFreshRandomId) {
  KvPool pool(*receiver_, compat_, 8);
  ASSERT_TRUE(receiver_->expect(1, Clock::now() + kHangGuard, out_.onArrival()).ok());
  auto granted = receiver_->grant(1, ungranted(pool, 1, 6, {5, 2}));
  ASSERT_TRUE(granted.ok()) << granted.error().toString();
  EXPECT_FALSE(granted->transfer_id.empty());
  EXPECT_NE(granted->transfer_id.hi, 0U);  // not derived from the local request number
  // The id travels in the descriptor's bytes.
  auto wire = decodeKvDescriptor(encode(granted.value()));
  ASSERT_TRUE(wire.ok());
  EXPECT_EQ(wire->transfer_id, granted->transfer_id);
  send(wire.value(), 6);
  const auto arrived = out_.waitArrival(1, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_TRUE(arrived->ok()) << arrived->error().toString();
  EXPECT_EQ(pool.verify(granted.value(), 5), "");

  // Another grant gets another id, differing in both halves.
  ASSERT_TRUE(receiver_->expect(2, Clock::now() + kHangGuard, out_.onArrival()).ok());
  auto again = receiver_->grant(2, ungranted(pool, 2, 6, {0, 1}));
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->transfer_id.hi, granted->transfer_id.hi);
  EXPECT_NE(again->transfer_id.lo, granted->transfer_id.lo);
  EXPECT_TRUE(receiver_->cancelExpect(2));
}

// The attack that confinement stops: a submission that names another request's blocks. With
// active messages the receiver refuses the bytes and fails the receive; the victim's blocks stay
// as they were.
TEST_P(WriteConfinement, DataForBlocksTheRequestDoesNotHoldIsRefused) {
  if (GetParam() == KvDataPath::Rma) {
    GTEST_SKIP() << "one-sided puts land without the receiver's CPU: docs/kv-transfer.md, 'Write confinement'";
  }
  KvPool pool(*receiver_, compat_, 8);
  ASSERT_TRUE(receiver_->expect(3, Clock::now() + kHangGuard, out_.onArrival()).ok());
  auto granted = receiver_->grant(3, ungranted(pool, 3, 6, {0, 1}));
  ASSERT_TRUE(granted.ok());
  KvDescriptor forged = granted.value();
  forged.block_ids = {6, 7};  // a victim's blocks
  send(forged, 6);
  const auto arrived = out_.waitArrival(3, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_FALSE(arrived->ok());
  EXPECT_EQ(arrived->error().code, ErrorCode::Corrupt);
  EXPECT_NE(arrived->error().message.find("outside the blocks the request holds"), std::string::npos)
      << arrived->error().message;
  KvDescriptor nothing = granted.value();
  nothing.num_tokens = 0;  // verify: no token expected, every block untouched
  EXPECT_EQ(pool.verify(nothing, 5), "");
  EXPECT_GT(receiver_->stats().bytes_dropped, 0U);
}

// Decode-side prefix reuse (docs/kv-memory.md): a descriptor's present blocks hold the prefix
// cache's KV, shared with other requests and read-only, so the grant leaves them out. An honest
// sender puts only the tokens after them and the receive completes on those bytes; a sender that
// writes them anyway (the descriptor edited back to present_tokens 0) has those bytes refused and
// the receive fails.
TEST_P(WriteConfinement, PresentBlocksAreNeverGrantedForWriting) {
  KvPool pool(*receiver_, compat_, 8);
  ASSERT_TRUE(receiver_->expect(4, Clock::now() + kHangGuard, out_.onArrival()).ok());
  KvDescriptor d = ungranted(pool, 4, 10, {5, 2, 7});
  d.present_tokens = 4;  // block 5
  auto granted = receiver_->grant(4, d);
  ASSERT_TRUE(granted.ok()) << granted.error().toString();
  const auto wire = decodeKvDescriptor(encode(granted.value()));
  ASSERT_TRUE(wire.ok());
  ASSERT_EQ(wire->present_tokens, 4U);
  const std::uint64_t received_before = receiver_->stats().bytes_received;
  {
    SourceKv source(compat_, 10, 5);
    ScopedRegion src(*sender_, source.bytes);
    ASSERT_TRUE(src.ok());
    ASSERT_TRUE(sender_->beginTransfer(wire.value(), Clock::now() + kHangGuard, out_.onDone()).ok());
    // The sender's own plan refuses the present tokens too.
    EXPECT_FALSE(sender_->put(wire->transfer_id, source.chunkPuts(src.id(), 0, 10)).ok());
    ASSERT_TRUE(sender_->put(wire->transfer_id, source.chunkPuts(src.id(), 4, 6)).ok());
    CompletionRecord r;
    r.transfer_id = wire->transfer_id;
    r.num_tokens = 10;
    ASSERT_TRUE(sender_->finish(r).ok());
    ASSERT_TRUE(out_.waitDone(wire->transfer_id.lo, kHangGuard).has_value());
  }
  const auto arrived = out_.waitArrival(4, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_TRUE(arrived->ok()) << arrived->error().toString();
  if (GetParam() == KvDataPath::ActiveMessage) {
    EXPECT_EQ(receiver_->stats().bytes_received - received_before, 6ULL * compat_.num_layers * compat_.tokenBytes());
  } else {
    GTEST_SKIP() << "one-sided puts land without the receiver's CPU: docs/kv-transfer.md, 'Write confinement'";
  }
  // Another request on the same present block 5.
  ASSERT_TRUE(receiver_->expect(6, Clock::now() + kHangGuard, out_.onArrival()).ok());
  KvDescriptor shared = ungranted(pool, 6, 10, {5, 3, 4});
  shared.present_tokens = 4;
  auto third = receiver_->grant(6, shared);
  ASSERT_TRUE(third.ok());
  KvDescriptor forged = third.value();
  forged.present_tokens = 0;  // writes block 5 after all
  send(forged, 10);
  const auto refused = out_.waitArrival(6, kHangGuard);
  ASSERT_TRUE(refused.has_value());
  ASSERT_FALSE(refused->ok());
  EXPECT_EQ(refused->error().code, ErrorCode::Corrupt);
  EXPECT_GT(receiver_->stats().bytes_dropped, 0U);
}

// Only the granted 128-bit id opens a request: data and records under any other id (one bit off
// the real one, one made from the local request number, the id of a transfer that already
// ended) are dropped and counted, and the receive is left to its own outcome: it is still
// pending after the receiver refused every forged record (events the test waits on; no deadline
// orders them).
TEST_P(WriteConfinement, DataAndRecordsUnderAGuessedOrStaleTransferIdAreDropped) {
  KvPool pool(*receiver_, compat_, 8);
  ASSERT_TRUE(receiver_->expect(41, Clock::now() + kHangGuard, out_.onArrival()).ok());
  auto ended = receiver_->grant(41, ungranted(pool, 41, 6, {2, 3}));
  ASSERT_TRUE(ended.ok());
  send(ended.value(), 6);
  const auto first = out_.waitArrival(41, kHangGuard);
  ASSERT_TRUE(first.has_value() && first->ok());

  ASSERT_TRUE(receiver_->expect(4, Clock::now() + kHangGuard, out_.onArrival()).ok());
  const KvDescriptor plain = ungranted(pool, 4, 6, {0, 1});
  auto granted = receiver_->grant(4, plain);
  ASSERT_TRUE(granted.ok());
  const std::uint64_t rejected_before = receiver_->stats().records_rejected;
  std::vector<KvDescriptor> forged(3, granted.value());
  forged[0].transfer_id.lo ^= 1;               // one bit off the live id
  forged[1].transfer_id = tid(4);              // made from the request's local number
  forged[2].transfer_id = ended->transfer_id;  // a finished transfer's id
  for (const KvDescriptor& f : forged) {
    // Each send waits on its own outcomes: forged[2] reuses the ended transfer's id, whose
    // outcome out_ already holds, so waiting there would return before this transfer ends (and
    // the sender would still count it in flight when the test tears down).
    Outcomes sent;
    send(f, 6, &sent);
  }
  ASSERT_TRUE(testutil::eventually([&] { return receiver_->stats().records_rejected >= rejected_before + 3; }))
      << "the receiver did not refuse every forged record";
  EXPECT_FALSE(out_.waitArrival(4, 0ms).has_value()) << "a forged record ended the receive";
  if (GetParam() == KvDataPath::ActiveMessage) {
    EXPECT_GT(receiver_->stats().bytes_dropped, 0U);
    // Only the ended transfer's blocks hold KV; request 4's blocks and every other are untouched.
    EXPECT_EQ(pool.verify(ended.value(), 5), "");
  }
  EXPECT_TRUE(receiver_->cancelExpect(4)) << "the receive ended before its own outcome";
  const auto arrived = out_.waitArrival(4, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_FALSE(arrived->ok());
  EXPECT_EQ(arrived->error().code, ErrorCode::Cancelled) << arrived->error().toString();
}

TEST_P(WriteConfinement, ACompletionRecordForAnotherTokenCountFailsTheReceive) {
  KvPool pool(*receiver_, compat_, 8);
  ASSERT_TRUE(receiver_->expect(5, Clock::now() + kHangGuard, out_.onArrival()).ok());
  auto granted = receiver_->grant(5, ungranted(pool, 5, 6, {3, 4}));
  ASSERT_TRUE(granted.ok());
  send(granted.value(), 7);
  const auto arrived = out_.waitArrival(5, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_FALSE(arrived->ok());
  EXPECT_EQ(arrived->error().code, ErrorCode::Corrupt);
  EXPECT_NE(arrived->error().message.find("claims 7 tokens"), std::string::npos) << arrived->error().message;
}

TEST_P(WriteConfinement, GrantRefusesUnexpectedRequestsAndForeignTargets) {
  KvPool pool(*receiver_, compat_, 8);
  const KvDescriptor d = ungranted(pool, 6, 6, {0, 1});
  auto unexpected = receiver_->grant(6, d);
  ASSERT_FALSE(unexpected.ok());
  EXPECT_EQ(unexpected.error().code, ErrorCode::NotFound);
  ASSERT_TRUE(receiver_->expect(6, Clock::now() + kHangGuard, out_.onArrival()).ok());
  auto foreign = sender_->grant(6, d);  // the sender expects nothing
  EXPECT_FALSE(foreign.ok());
  ASSERT_TRUE(sender_->expect(6, Clock::now() + kHangGuard, out_.onArrival()).ok());
  foreign = sender_->grant(6, d);  // expected there, but the descriptor names the receiver only
  ASSERT_FALSE(foreign.ok());
  EXPECT_EQ(foreign.error().code, ErrorCode::InvalidArgument);
  // One id per request, one request per id.
  auto granted = receiver_->grant(6, d);
  ASSERT_TRUE(granted.ok());
  EXPECT_TRUE(receiver_->grant(6, granted.value()).ok()) << "granting the same id again is idempotent";
  EXPECT_EQ(receiver_->grant(6, d).error().code, ErrorCode::InvalidArgument) << "a second, different id";
  ASSERT_TRUE(receiver_->expect(7, Clock::now() + kHangGuard, out_.onArrival()).ok());
  EXPECT_EQ(receiver_->grant(7, granted.value()).error().code, ErrorCode::InvalidArgument) << "another request's id";
  EXPECT_TRUE(receiver_->cancelExpect(7));
  EXPECT_TRUE(sender_->cancelExpect(6));
  EXPECT_TRUE(receiver_->cancelExpect(6));
}

// With TP a descriptor lists every decode rank; the first rank's grant draws the id and the
// others keep it, so one id opens every rank's blocks and only those.
TEST_P(WriteConfinement, EveryTpRankGrantsTheSameDescriptorWithOneKey) {
  compat_.tp_size = 2;
  sender_ = makeTransport(GetParam(), compat_, "prefill");
  receiver_ = makeTransport(GetParam(), compat_, "decode0");
  auto rank1 = makeTransport(GetParam(), compat_, "decode1");
  ASSERT_TRUE(sender_ && receiver_ && rank1);
  Outcomes out1;
  {
    KvPool pool0(*receiver_, compat_, 8);
    KvPool pool1(*rank1, compat_, 8);
    KvDescriptor d = ungranted(pool0, 8, 6, {1, 6});
    d.targets.push_back(pool1.target(1).value());
    ASSERT_TRUE(receiver_->expect(8, Clock::now() + kHangGuard, out_.onArrival()).ok());
    ASSERT_TRUE(rank1->expect(8, Clock::now() + kHangGuard, out1.onArrival()).ok());
    auto first = receiver_->grant(8, d);
    ASSERT_TRUE(first.ok()) << first.error().toString();
    auto second = rank1->grant(8, first.value());
    ASSERT_TRUE(second.ok()) << second.error().toString();
    EXPECT_EQ(second->transfer_id, first->transfer_id);
    send(second.value(), 6);
    for (auto* o : {&out_, &out1}) {
      const auto arrived = o->waitArrival(8, kHangGuard);
      ASSERT_TRUE(arrived.has_value());
      EXPECT_TRUE(arrived->ok()) << arrived->error().toString();
    }
    EXPECT_EQ(pool0.verify(second.value(), 5), "");
    EXPECT_EQ(pool1.verify(second.value(), 5), "");
  }
  EXPECT_EQ(rank1->stats().pending_receives, 0);
}

std::shared_ptr<const InternalAuth> clusterSecret(char fill) {
  auto auth =
      InternalAuth::create({std::vector<std::uint8_t>(kMinClusterSecretBytes, static_cast<std::uint8_t>(fill))});
  PD_CHECK(auth.ok());
  return std::move(auth).value();
}

// With a cluster secret, a record must carry its tag: one from the descriptor's holder (it has the
// transfer id) that is unsigned or signed with another secret fails the receive at once
// (Unauthenticated, counted), and the same transfer signed with the right secret lands.
TEST_P(WriteConfinement, RecordsMustBeSignedWithTheClusterSecret) {
  const auto secret = clusterSecret('a');
  receiver_ = makeTransport(GetParam(), compat_, "decode", "", secret);
  ASSERT_TRUE(receiver_);
  KvPool pool(*receiver_, compat_, 8);
  struct Case {
    std::shared_ptr<const InternalAuth> sender_secret;
    std::string why;  // empty: accepted
  };
  const std::vector<Case> cases = {{nullptr, "not signed with the cluster secret"},
                                   {clusterSecret('b'), "signed with another secret or altered"},
                                   {secret, ""}};
  std::uint64_t id = 20;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.why);
    sender_ = makeTransport(GetParam(), compat_, "prefill", "", c.sender_secret);
    ASSERT_TRUE(sender_);
    ASSERT_TRUE(receiver_->expect(id, Clock::now() + kHangGuard, out_.onArrival()).ok());
    auto granted = receiver_->grant(id, ungranted(pool, id, 6, {2, 5}));
    ASSERT_TRUE(granted.ok());
    send(granted.value(), 6);
    const auto arrived = out_.waitArrival(id, kHangGuard);
    ASSERT_TRUE(arrived.has_value());
    if (c.why.empty()) {
      EXPECT_TRUE(arrived->ok()) << arrived->error().toString();
      EXPECT_EQ(pool.verify(granted.value(), 5), "");
    } else {
      ASSERT_FALSE(arrived->ok());
      EXPECT_EQ(arrived->error().code, ErrorCode::Unauthenticated);
      EXPECT_NE(arrived->error().message.find(c.why), std::string::npos) << arrived->error().message;
    }
    ++id;
  }
  const TransportStats stats = receiver_->stats();
  EXPECT_EQ(stats.records_unauthenticated, 2U);
  EXPECT_EQ(stats.receives_succeeded, 1U);
  EXPECT_EQ(stats.receives_failed[static_cast<std::size_t>(FailureCause::Rejected)], 2U);
}

// Without the transfer id, an unsigned record is dropped and the receive goes on: a guessed id
// cannot end someone else's receive, signed or not.
TEST_P(WriteConfinement, AnUnsignedRecordUnderAGuessedIdIsDroppedAndTheRealOneLands) {
  const auto secret = clusterSecret('a');
  receiver_ = makeTransport(GetParam(), compat_, "decode", "", secret);
  auto forger = makeTransport(GetParam(), compat_, "forger");
  sender_ = makeTransport(GetParam(), compat_, "prefill", "", secret);
  ASSERT_TRUE(receiver_ && forger && sender_);
  KvPool pool(*receiver_, compat_, 8);
  ASSERT_TRUE(receiver_->expect(30, Clock::now() + kHangGuard, out_.onArrival()).ok());
  const KvDescriptor plain = ungranted(pool, 30, 6, {1, 3});
  auto granted = receiver_->grant(30, plain);
  ASSERT_TRUE(granted.ok());
  {
    Outcomes forged;
    KvDescriptor guess = plain;
    guess.transfer_id = tid(30);
    std::swap(sender_, forger);
    send(guess, 6, &forged);  // a guessed id, no tag
    std::swap(sender_, forger);
  }
  ASSERT_TRUE(testutil::eventually([&] { return receiver_->stats().records_rejected != 0; }));
  ASSERT_EQ(receiver_->stats().records_rejected, 1U);
  EXPECT_EQ(receiver_->stats().records_unauthenticated, 0U) << "dropped for its id, before its tag is checked";
  EXPECT_FALSE(out_.waitArrival(30, 0ms).has_value()) << "the forged record ended the receive";
  send(granted.value(), 6);
  const auto arrived = out_.waitArrival(30, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  EXPECT_TRUE(arrived->ok()) << arrived->error().toString();
  EXPECT_EQ(pool.verify(granted.value(), 5), "");
  EXPECT_GE(receiver_->stats().records_rejected, 1U);
}

// A decode transport looks data and records up by granted ids only, so it takes no KV and no
// record for a request that is expected but not (yet) granted: an id opens nothing before grant()
// binds it (here with a cluster secret and a correctly signed record; the guessed-id test above
// runs without one). The receive is still pending after the receiver
// refused the record (waited on as an event).
TEST_P(WriteConfinement, AReceiverTakesNothingForAnUngrantedRequest) {
  const auto secret = clusterSecret('a');
  receiver_ = makeTransport(GetParam(), compat_, "decode", "", secret);
  sender_ = makeTransport(GetParam(), compat_, "prefill", "", secret);
  ASSERT_TRUE(receiver_ && sender_);
  KvPool pool(*receiver_, compat_, 8);
  ASSERT_TRUE(receiver_->expect(40, Clock::now() + kHangGuard, out_.onArrival()).ok());
  const KvDescriptor plain = pool.descriptor(40, 6, {0, 1}, testutil::kHangGuardMs).value();  // tid(40)
  send(plain, 6);  // signed with the right secret, but for an id never granted
  ASSERT_TRUE(testutil::eventually([&] { return receiver_->stats().records_rejected >= 1; }))
      << "the receiver never refused the record of the ungranted request";
  EXPECT_FALSE(out_.waitArrival(40, 0ms).has_value()) << "the record of an ungranted request ended the receive";
  if (GetParam() == KvDataPath::ActiveMessage) {
    KvDescriptor nothing = plain;
    nothing.num_tokens = 0;
    EXPECT_EQ(pool.verify(nothing, 5), "");
    EXPECT_GT(receiver_->stats().bytes_dropped, 0U);
  }
  EXPECT_TRUE(receiver_->cancelExpect(40)) << "the receive ended before its own outcome";
  const auto arrived = out_.waitArrival(40, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  ASSERT_FALSE(arrived->ok());
  EXPECT_EQ(arrived->error().code, ErrorCode::Cancelled) << arrived->error().toString();
}

INSTANTIATE_TEST_SUITE_P(Ucx, WriteConfinement, ::testing::Values(KvDataPath::ActiveMessage, KvDataPath::Rma),
                         [](const auto& p) { return std::string(kvDataPathName(p.param)); });

// ---- listening interface --------------------------------------------------------------------------

std::set<std::string> socketInodes() {
  std::set<std::string> inodes;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return inodes;
  while (const dirent* e = ::readdir(dir)) {
    char target[256] = {};
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
    const std::string link(target, n > 0 ? static_cast<std::size_t>(n) : 0);
    if (link.rfind("socket:[", 0) == 0) inodes.insert(link.substr(8, link.size() - 9));
  }
  ::closedir(dir);
  return inodes;
}

/// Local addresses (hex, as /proc/net/tcp{,6} print them) of listening sockets among `inodes`.
std::vector<std::string> listeningAddresses(const std::set<std::string>& inodes) {
  std::vector<std::string> out;
  for (const char* file : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (state == "0A" && inodes.contains(inode)) out.push_back(local.substr(0, local.find(':')));
    }
  }
  return out;
}

bool isLoopbackHex(const std::string& hex) {
  return hex == "0100007F" || hex == "00000000000000000000000001000000";
}

TEST(UcxListeningInterface, LoopbackHostListensOnLoopbackOnly) {
  const auto before = socketInodes();
  auto t = makeTransport(KvDataPath::Auto, testutil::smallCompat(), "loopback", "127.0.0.1");
  ASSERT_TRUE(t);
  std::set<std::string> mine;
  for (const auto& inode : socketInodes()) {
    if (!before.contains(inode)) mine.insert(inode);
  }
  const auto addresses = listeningAddresses(mine);
  ASSERT_FALSE(addresses.empty()) << "UCX's tcp transport opened no listening socket";
  for (const auto& a : addresses) EXPECT_TRUE(isLoopbackHex(a)) << "listening on " << a;

  // Without a host, UCX listens on every interface (checked where this machine has another one).
  const auto before_all = socketInodes();
  auto all = makeTransport(KvDataPath::Auto, testutil::smallCompat(), "all");
  ASSERT_TRUE(all);
  std::set<std::string> theirs;
  for (const auto& inode : socketInodes()) {
    if (!before_all.contains(inode)) theirs.insert(inode);
  }
  const auto everywhere = listeningAddresses(theirs);
  const bool other = std::any_of(everywhere.begin(), everywhere.end(), [](const auto& a) { return !isLoopbackHex(a); });
  if (!other) GTEST_SKIP() << "this machine has no interface but loopback for UCX";
  EXPECT_GT(everywhere.size(), addresses.size());

  // The loopback-only transport still talks to one on every interface.
  KvPool pool(*t, testutil::smallCompat(), 4);
  Outcomes out;
  SourceKv source(testutil::smallCompat(), 3, 9);
  ScopedRegion src(*all, source.bytes);
  auto d = pool.descriptor(9, 3, {2}, testutil::kHangGuardMs);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(t->expect(9, Clock::now() + kHangGuard, out.onArrival()).ok());
  ASSERT_TRUE(t->grant(9, d.value()).ok());
  ASSERT_TRUE(all->beginTransfer(d.value(), Clock::now() + kHangGuard, out.onDone()).ok());
  ASSERT_TRUE(all->put(tid(9), source.chunkPuts(src.id(), 0, 3)).ok());
  CompletionRecord r;
  r.transfer_id = tid(9);
  r.num_tokens = 3;
  ASSERT_TRUE(all->finish(r).ok());
  const auto arrived = out.waitArrival(9, kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  EXPECT_TRUE(arrived->ok()) << arrived->error().toString();
  EXPECT_EQ(pool.verify(d.value(), 9), "");
  // The sender's own outcome too: `out` dies before the transports, so its callback must have run
  // by now (an ASan run caught it landing in the destroyed map at shutdown).
  const auto done = out.waitDone(9, kHangGuard);
  ASSERT_TRUE(done.has_value());
  EXPECT_TRUE(done->ok()) << done->error().toString();
}

TEST(UcxListeningInterface, AHostThatIsNoLocalAddressIsRefused) {
  UcxTransportOptions options;
  options.ucx_tls = "tcp";
  options.compat = testutil::smallCompat();
  options.host = "192.0.2.254";  // TEST-NET-1: not configured here
  options.name = "nohost";
  if (auto t = createUcxTransport(options); t.ok()) {
    GTEST_SKIP() << "192.0.2.254 is configured on this machine";
  } else {
    EXPECT_EQ(t.error().code, ErrorCode::InvalidArgument);
    EXPECT_NE(t.error().message.find("no address of this host"), std::string::npos) << t.error().message;
  }
  options.host = "not-an-ip";
  auto bad = createUcxTransport(options);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, ErrorCode::InvalidArgument);
}

}  // namespace
}  // namespace pd::kvtransfer
