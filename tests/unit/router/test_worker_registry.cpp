// Worker registry (health polling, rotation rules, DNS discovery), the selection policies, the
// router's worker options (list options from YAML and flags), and stop strings.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "fakes/fake_workers.h"
#include "pd/common/config.h"
#include "pd/router/router_config.h"
#include "pd/router/stop_strings.h"
#include "pd/router/worker_policy.h"
#include "pd/router/worker_registry.h"
#include "support/test_files.h"

namespace pd::router {
namespace {

using namespace std::chrono_literals;
using fakes::FakeDecodeWorker;
using fakes::FakePrefillWorker;

template <class Pred>
bool waitFor(Pred pred, std::chrono::milliseconds timeout = 5000ms) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

WorkerAddress addr(const std::string& text) {
  return parseWorkerAddress(text, "test").value();
}

std::optional<WorkerState> stateOf(const WorkerRegistry& r, const std::string& key) {
  for (auto& s : r.workers()) {
    if (s.address.key() == key) return s;
  }
  return std::nullopt;
}

RegistryOptions fastOptions() {
  RegistryOptions o;
  o.health_interval = 10ms;
  o.health_timeout = 500ms;
  o.health_failures = 3;
  return o;
}

TEST(WorkerAddressTest, ParsesHostPortAndRejectsGarbage) {
  EXPECT_EQ(addr("decode-0.pd:8100").host, "decode-0.pd");
  EXPECT_EQ(addr("decode-0.pd:8100").port, 8100);
  EXPECT_EQ(addr("[::1]:9000").host, "::1");
  EXPECT_EQ(addr("[::1]:9000").key(), "[::1]:9000");
  for (const char* bad : {"nohost", ":80", "h:0", "h:65536", "h:x", "::1:80", "h:"}) {
    auto r = parseWorkerAddress(bad, "router.decode_workers");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().code, ErrorCode::InvalidArgument);
    EXPECT_NE(r.error().message.find("router.decode_workers"), std::string::npos);
  }
}

TEST(WorkerRegistryTest, PolledWorkerJoinsRotationWithItsStatus) {
  FakeDecodeWorker d;
  auto o = fastOptions();
  o.decode_workers = {addr(d.address())};
  auto reg = WorkerRegistry::start(o).value();
  ASSERT_TRUE(waitFor([&] { return reg->hasReady(WorkerRole::Decode); }));
  EXPECT_FALSE(reg->hasReady(WorkerRole::Prefill));
  const auto ready = reg->ready(WorkerRole::Decode);
  ASSERT_EQ(ready.size(), 1U);
  EXPECT_EQ(ready[0].status.free_blocks, 100);
  EXPECT_EQ(ready[0].status.block_size, 16);
  reg->noteSent(WorkerRole::Decode, d.address(), 40);
  // The next good poll resets what the router counted since the last one.
  const int polls = d.statusPolls();
  ASSERT_TRUE(waitFor([&] { return d.statusPolls() > polls + 1; }));
  EXPECT_EQ(reg->ready(WorkerRole::Decode)[0].sent_tokens, 0);
}

TEST(WorkerRegistryTest, PublishesEachWorkersStateAsGauges) {
  FakeDecodeWorker d;
  worker_api::WorkerStatus st = d.status();
  st.drafts_proposed = 50;
  st.drafts_accepted = 36;
  d.setStatus(st);
  metrics::Registry metrics;
  auto o = fastOptions();
  o.health_interval = 50ms;
  o.decode_workers = {addr(d.address())};
  o.metrics = &metrics;
  auto reg = WorkerRegistry::start(o).value();
  const std::string labels = "{role=\"decode\",worker=\"" + d.address() + "\"}";
  const auto has = [&](const std::string& sample) { return metrics.render().find(sample) != std::string::npos; };
  ASSERT_TRUE(waitFor([&] { return has("pdserve_router_worker_in_rotation" + labels + " 1"); })) << metrics.render();
  EXPECT_TRUE(has("pdserve_router_worker_kv_blocks_free" + labels + " 100")) << metrics.render();
  EXPECT_TRUE(has("pdserve_router_worker_mtp_drafts_accepted" + labels + " 36"));
  d.setStatusFails(true);
  ASSERT_TRUE(waitFor([&] { return has("pdserve_router_worker_in_rotation" + labels + " 0"); })) << metrics.render();
}

TEST(WorkerRegistryTest, FailingWorkerLeavesRotationAfterNPollsAndComesBack) {
  FakeDecodeWorker d;
  auto o = fastOptions();
  o.health_interval = 50ms;
  o.decode_workers = {addr(d.address())};
  auto reg = WorkerRegistry::start(o).value();
  ASSERT_TRUE(waitFor([&] { return reg->hasReady(WorkerRole::Decode); }));
  // Counted before failing starts: a poll already in flight may fail too, and is then counted.
  const int polls = d.statusPolls();
  d.setStatusFails(true);
  ASSERT_TRUE(waitFor([&] { return !reg->hasReady(WorkerRole::Decode); }));
  // Not on the first failed poll: after health_failures of them.
  EXPECT_GE(d.statusPolls() - polls, 3);
  auto s = stateOf(*reg, d.address());
  ASSERT_TRUE(s);
  EXPECT_GE(s->consecutive_failures, 3);
  EXPECT_NE(s->reason.find("failures in a row"), std::string::npos) << s->reason;
  d.setStatusFails(false);
  ASSERT_TRUE(waitFor([&] { return reg->hasReady(WorkerRole::Decode); }));
  EXPECT_TRUE(stateOf(*reg, d.address())->reason.empty());
}

TEST(WorkerRegistryTest, UnreachableWorkerIsNeverInRotation) {
  std::string dead;
  {
    FakeDecodeWorker d;
    dead = d.address();
  }  // its port is closed now
  auto o = fastOptions();
  o.decode_workers = {addr(dead)};
  auto reg = WorkerRegistry::start(o).value();
  ASSERT_TRUE(waitFor([&] { return stateOf(*reg, dead) && stateOf(*reg, dead)->consecutive_failures >= 3; }));
  EXPECT_FALSE(reg->hasReady(WorkerRole::Decode));
  EXPECT_NE(stateOf(*reg, dead)->reason.find("status poll failed"), std::string::npos);
}

TEST(WorkerRegistryTest, DrainingNotReadyWrongRoleAndOtherModelAreOutOfRotationAtOnce) {
  FakeDecodeWorker d;
  FakeDecodeWorker wrong_role;  // a decode worker listed as prefill
  std::vector<FakeDecodeWorker*> none;
  FakePrefillWorker p(none);
  auto o = fastOptions();
  o.decode_workers = {addr(d.address())};
  o.prefill_workers = {addr(p.address()), addr(wrong_role.address())};
  o.model_hash = fakes::kFakeModelHash;
  auto reg = WorkerRegistry::start(o).value();
  ASSERT_TRUE(waitFor([&] { return reg->hasReady(WorkerRole::Decode) && reg->hasReady(WorkerRole::Prefill); }));
  ASSERT_TRUE(waitFor([&] { return stateOf(*reg, wrong_role.address())->good_polls > 0; }));
  EXPECT_FALSE(stateOf(*reg, wrong_role.address())->in_rotation);
  EXPECT_NE(stateOf(*reg, wrong_role.address())->reason.find("role 'decode'"), std::string::npos);
  EXPECT_EQ(reg->ready(WorkerRole::Prefill).size(), 1U);

  auto s = d.status();
  s.draining = true;
  d.setStatus(s);
  ASSERT_TRUE(waitFor([&] { return !reg->hasReady(WorkerRole::Decode); }));
  EXPECT_EQ(stateOf(*reg, d.address())->reason, "draining");
  s.draining = false;
  s.ready = false;
  d.setStatus(s);
  ASSERT_TRUE(waitFor([&] { return stateOf(*reg, d.address())->reason == "not ready"; }));
  s.ready = true;
  s.model_hash = "ffffffffffffffff";
  d.setStatus(s);
  ASSERT_TRUE(waitFor([&] { return stateOf(*reg, d.address())->reason.find("model_hash") != std::string::npos; }));
  EXPECT_FALSE(reg->hasReady(WorkerRole::Decode));
  s.model_hash = fakes::kFakeModelHash;
  d.setStatus(s);
  ASSERT_TRUE(waitFor([&] { return reg->hasReady(WorkerRole::Decode); }));
}

// A busy worker (pool or queue full, /ready 503) is healthy: it stays in rotation with nothing
// counted against it, but work goes to the others while any of them has room.
TEST(WorkerRegistryTest, BusyWorkerStaysInRotationButIsOfferedOnlyWhenAllAreBusy) {
  FakeDecodeWorker a;
  FakeDecodeWorker b;
  auto o = fastOptions();
  o.decode_workers = {addr(a.address()), addr(b.address())};
  auto reg = WorkerRegistry::start(o).value();
  const auto offered = [&] {
    std::vector<std::string> keys;
    for (const auto& v : reg->ready(WorkerRole::Decode)) keys.push_back(v.address.key());
    return keys;
  };
  ASSERT_TRUE(waitFor([&] { return offered().size() == 2; }));

  auto busy = a.status();
  busy.ready = false;
  busy.busy = true;
  a.setStatus(busy);
  ASSERT_TRUE(waitFor([&] { return offered() == std::vector<std::string>{b.address()}; }));
  const auto st = stateOf(*reg, a.address());
  ASSERT_TRUE(st.has_value());
  EXPECT_TRUE(st->in_rotation);
  EXPECT_TRUE(st->reason.empty()) << st->reason;
  EXPECT_EQ(st->consecutive_failures, 0);

  // Both busy: both are offered (the router is not closed at the door), and hasReady holds.
  b.setStatus(busy);
  ASSERT_TRUE(waitFor([&] { return offered().size() == 2 && reg->ready(WorkerRole::Decode)[0].status.busy; }));
  EXPECT_TRUE(reg->hasReady(WorkerRole::Decode));

  // Room again on a: a alone is offered; then both.
  auto idle = busy;
  idle.ready = true;
  idle.busy = false;
  a.setStatus(idle);
  ASSERT_TRUE(waitFor([&] { return offered() == std::vector<std::string>{a.address()}; }));
  b.setStatus(idle);
  ASSERT_TRUE(waitFor([&] { return offered().size() == 2; }));

  // Not ready without being busy (a broken tensor-parallel group) still leaves rotation.
  auto broken = idle;
  broken.ready = false;
  a.setStatus(broken);
  ASSERT_TRUE(waitFor([&] { return stateOf(*reg, a.address())->reason == "not ready"; }));
  EXPECT_EQ(offered(), std::vector<std::string>{b.address()});
}

TEST(WorkerRegistryTest, FirstReportedModelHashIsPinnedWhenNoneIsConfigured) {
  FakeDecodeWorker d;
  std::vector<FakeDecodeWorker*> none;
  FakePrefillWorker p(none);
  auto ps = p.status();
  ps.model_hash = "1111111111111111";
  p.setStatus(ps);
  p.setStatusFails(true);  // d is polled good first
  auto o = fastOptions();
  o.decode_workers = {addr(d.address())};
  o.prefill_workers = {addr(p.address())};
  auto reg = WorkerRegistry::start(o).value();
  ASSERT_TRUE(waitFor([&] { return reg->hasReady(WorkerRole::Decode); }));
  p.setStatusFails(false);
  ASSERT_TRUE(waitFor([&] { return stateOf(*reg, p.address())->good_polls > 0; }));
  EXPECT_FALSE(reg->hasReady(WorkerRole::Prefill));
  EXPECT_NE(stateOf(*reg, p.address())->reason.find("differs"), std::string::npos);
}

TEST(WorkerRegistryTest, ReportedRequestFailuresCountLikeFailedPolls) {
  FakeDecodeWorker d;
  auto o = fastOptions();
  o.health_interval = 60000ms;  // one poll; the rest comes from the reports
  o.health_failures = 2;
  o.decode_workers = {addr(d.address())};
  auto reg = WorkerRegistry::start(o).value();
  ASSERT_TRUE(waitFor([&] { return reg->hasReady(WorkerRole::Decode); }));
  reg->reportFailure(WorkerRole::Decode, d.address(), "connection refused");
  EXPECT_TRUE(reg->hasReady(WorkerRole::Decode));
  reg->reportFailure(WorkerRole::Decode, d.address(), "connection refused");
  EXPECT_FALSE(reg->hasReady(WorkerRole::Decode));
}

TEST(WorkerRegistryTest, DnsDiscoveryFindsTheWorkerBehindAName) {
  FakeDecodeWorker d;
  auto o = fastOptions();
  o.discovery_interval = 100ms;
  o.decode_service = addr("localhost:" + std::to_string(d.port()));
  auto reg = WorkerRegistry::start(o).value();
  const std::string key = "127.0.0.1:" + std::to_string(d.port());
  ASSERT_TRUE(waitFor([&] {
    auto s = stateOf(*reg, key);
    return s && s->in_rotation;
  }));
  EXPECT_TRUE(stateOf(*reg, key)->discovered);
  EXPECT_TRUE(reg->hasReady(WorkerRole::Decode));
}

TEST(WorkerRegistryTest, ResolveAllAndUnknownNames) {
  auto local = resolveAll("localhost", 80);
  ASSERT_TRUE(local.ok()) << local.error().toString();
  bool has_v4 = false;
  for (const auto& a : local.value()) has_v4 = has_v4 || a.host == "127.0.0.1";
  EXPECT_TRUE(has_v4);
  auto missing = resolveAll("no-such-host.invalid", 80);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, ErrorCode::NotFound);
}

WorkerView view(std::int64_t queued_tokens, std::int64_t free_blocks, std::int64_t running, std::int64_t sent_req = 0,
                std::int64_t sent_tokens = 0) {
  WorkerView v;
  v.status.queued_tokens = queued_tokens;
  v.status.free_blocks = free_blocks;
  v.status.running_requests = running;
  v.status.block_size = 16;
  v.sent_requests = sent_req;
  v.sent_tokens = sent_tokens;
  return v;
}

TEST(WorkerPolicyTest, LeastQueuedTokensCountsWhatWasSentSinceThePoll) {
  auto p = makeLeastQueuedTokensPolicy();
  std::vector<WorkerView> c{view(500, 0, 0), view(100, 0, 0), view(300, 0, 0)};
  EXPECT_EQ(p->choose(c, {}).index, 1U);
  c[1].sent_tokens = 450;  // the router just sent it 450 tokens
  c[1].sent_requests = 1;
  EXPECT_EQ(p->choose(c, {}).index, 2U);
  // Equal tokens: fewer requests wins.
  std::vector<WorkerView> tie{view(0, 0, 3), view(0, 0, 1)};
  EXPECT_EQ(p->choose(tie, {}).index, 1U);
}

TEST(WorkerPolicyTest, RoundRobinTakesEachInTurn) {
  auto p = makeRoundRobinPolicy();
  std::vector<WorkerView> c{view(0, 0, 0), view(9, 0, 0), view(0, 0, 0)};
  EXPECT_EQ(p->choose(c, {}).index, 0U);
  EXPECT_EQ(p->choose(c, {}).index, 1U);
  EXPECT_EQ(p->choose(c, {}).index, 2U);
  EXPECT_EQ(p->choose(c, {}).index, 0U);
  EXPECT_TRUE(makePrefillPolicy("round_robin").ok());
  EXPECT_FALSE(makePrefillPolicy("random").ok());
}

TEST(WorkerPolicyTest, MostFreeBlocksThenFewestRunning) {
  auto p = makeMostFreeBlocksPolicy();
  std::vector<WorkerView> c{view(0, 100, 0), view(0, 300, 5), view(0, 200, 0)};
  EXPECT_EQ(p->choose(c, {}).index, 1U);
  // 1600 tokens sent to it since the poll: 100 blocks of 16 fewer leaves 200, as many as the
  // third one has, which runs fewer sequences.
  c[1].sent_tokens = 1600;
  c[1].sent_requests = 10;
  EXPECT_EQ(p->choose(c, {}).index, 2U);
  std::vector<WorkerView> tie{view(0, 100, 4), view(0, 100, 2), view(0, 100, 3)};
  EXPECT_EQ(p->choose(tie, {}).index, 1U);
}

TEST(RouterConfigTest, WorkerListsComeFromYamlSequencesAndCommaFlags) {
  test::TempDir dir;
  const auto yaml = dir.path() / "pd.yaml";
  std::ofstream(yaml) << "router:\n  decode_workers: [\"10.0.0.1:8100\", \"10.0.0.2:8100\"]\n"
                         "  prefill_workers:\n    - \"p-0:8200\"\n  decode_service: \"decode.pd.svc:8100\"\n";
  RouterConfig cfg;
  config::OptionSet set("router");
  registerOptions(set, cfg);
  config::LoadInput in;
  in.yaml_file = yaml;
  in.environment = std::map<std::string, std::string>{};
  in.args = {"--router.prefill-workers", "p-1:8200, p-2:8200"};
  auto out = config::loadConfig({&set}, {&set}, in);
  ASSERT_TRUE(out.ok()) << out.error().toString();
  EXPECT_EQ(cfg.decode_workers, (std::vector<std::string>{"10.0.0.1:8100", "10.0.0.2:8100"}));
  EXPECT_EQ(cfg.prefill_workers, (std::vector<std::string>{"p-1:8200", "p-2:8200"}));  // the flag wins
  auto ro = registryOptionsFromConfig(cfg);
  ASSERT_TRUE(ro.ok()) << ro.error().toString();
  EXPECT_EQ(ro.value().decode_workers.size(), 2U);
  ASSERT_TRUE(ro.value().decode_service);
  EXPECT_EQ(ro.value().decode_service->host, "decode.pd.svc");

  cfg.decode_workers = {"10.0.0.1"};
  auto bad = registryOptionsFromConfig(cfg);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("router.decode_workers"), std::string::npos);

  std::ofstream(yaml) << "router:\n  decode_workers: [[\"nested\"]]\n";
  auto nested = config::loadConfig({&set}, {&set}, config::LoadInput{yaml, {}, std::map<std::string, std::string>{}});
  EXPECT_FALSE(nested.ok());
}

TEST(StopStringsTest, CutsBeforeTheEarliestMatchAndHoldsBackPossiblePrefixes) {
  StopStringMatcher m({"###", "END"});
  auto a = m.push("Hello #");
  EXPECT_EQ(a.text, "Hello ");  // "#" might start "###"
  EXPECT_FALSE(a.matched);
  auto b = m.push("# not");
  EXPECT_EQ(b.text, "## not");  // no match, and no tail that could start one
  EXPECT_FALSE(b.matched);
  auto c = m.push(" the EN");
  EXPECT_EQ(c.text, " the ");
  auto d = m.push("D of it");
  EXPECT_TRUE(d.matched);
  EXPECT_EQ(d.text, "");
}

TEST(StopStringsTest, Exactness) {
  {
    StopStringMatcher m({"###"});
    std::string out;
    auto s1 = m.push("ab#");
    out += s1.text;
    EXPECT_EQ(out, "ab");
    auto s2 = m.push("#c");
    out += s2.text;
    EXPECT_EQ(out, "ab##c");  // "##c" cannot become "###"
    auto s3 = m.push("d##");
    out += s3.text;
    EXPECT_EQ(out, "ab##cd");
    auto s4 = m.push("#tail");
    EXPECT_TRUE(s4.matched);
    out += s4.text;
    EXPECT_EQ(out, "ab##cd");
    EXPECT_EQ(m.push("more").text, "");  // nothing after a match
  }
  {
    StopStringMatcher m({"world", "wo"});
    auto s = m.push("hello world");
    EXPECT_TRUE(s.matched);
    EXPECT_EQ(s.text, "hello ");
  }
  {
    StopStringMatcher m({"xyz"});
    auto s = m.push("abcx");
    EXPECT_EQ(s.text, "abc");
    EXPECT_EQ(m.flush(), "x");  // the end releases what was held
  }
  {
    StopStringMatcher m({});
    EXPECT_EQ(m.push("anything").text, "anything");
    EXPECT_TRUE(m.empty());
  }
}

}  // namespace
}  // namespace pd::router
