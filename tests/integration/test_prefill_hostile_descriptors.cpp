// Hostile KV descriptors against a real `pdserve prefill` process ("nothing unchecked
// reaches UCX"): this test plays the decode worker (a KvPool on its own UCX transport) and an
// attacker who POSTs prefill submissions whose descriptors carry mangled UCX worker addresses
// (first byte flipped, truncated, random bytes, oversized), mangled remote keys and block ids
// outside the pool. Each must get a 4xx naming the problem; the worker must stay alive and then
// serve a good request into the same decode pool.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "integration/prefill_worker_util.h"
#include "support/test_files.h"

namespace pd::prefill::testsupport {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string name;
  kvt::KvDescriptor descriptor;
  std::string needle;  // part of the error message
};

TEST(PrefillHostileDescriptors, MangledAddressesKeysAndBlocksAreRefusedAndTheWorkerLives) {
  const fs::path model = test::goldenDir() / "tiny-bf16";
  auto side = DecodeSide::create(model, 16, 8, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  WorkerProcess w({"--model.path", model.string(), "--prefill.threads", "1"});
  ASSERT_TRUE(w.ok());

  const std::vector<std::int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  const auto n = static_cast<std::uint32_t>(prompt.size());
  // The descriptors below are never expected by the decode side: a refused one must not start.
  const kvt::KvDescriptor good = (*side)->expect(100, n, {3, 4}, std::chrono::seconds(20));
  ASSERT_FALSE(good.targets.empty());
  const std::vector<std::uint8_t>& address = good.targets[0].worker_address;
  const std::vector<std::uint8_t>& rkey = good.targets[0].regions[0].rkey;
  ASSERT_GT(address.size(), 16U);
  ASSERT_GT(rkey.size(), 8U);

  std::mt19937 rng(21);
  const auto withAddress = [&](std::vector<std::uint8_t> a) {
    kvt::KvDescriptor d = good;
    d.targets[0].worker_address = std::move(a);
    return d;
  };
  const auto withRkey = [&](std::vector<std::uint8_t> k) {
    kvt::KvDescriptor d = good;
    d.targets[0].regions[0].rkey = std::move(k);
    return d;
  };
  std::vector<Case> cases;
  {
    auto a = address;
    a[0] ^= 0x02;  // address format version 2: UCX 1.13 asserts (exit 134) on it
    cases.push_back({"first byte flipped (version 2)", withAddress(a), "header"});
    a = address;
    a[0] ^= 0x01;  // format v2 over v1 bytes
    cases.push_back({"first byte flipped (version 1)", withAddress(a), "header"});
    a = address;
    a[0] ^= 0x80;  // a header flag
    cases.push_back({"first byte flipped (flags)", withAddress(a), "header"});
    a = address;
    a[0] = 0xff;  // version 15: UCX 1.13 asserts
    cases.push_back({"first byte 0xff", withAddress(a), "header"});
  }
  cases.push_back({"truncated to half", withAddress({address.begin(), address.begin() + address.size() / 2}),
                   "UCX worker address"});
  cases.push_back({"one byte short", withAddress({address.begin(), address.end() - 1}), "UCX worker address"});
  cases.push_back({"header only", withAddress({address.begin(), address.begin() + 1}), "truncated"});
  {
    auto a = address;
    a.push_back(0);
    cases.push_back({"one trailing byte", withAddress(a), "after the last device"});
  }
  for (int i = 0; i < 3; ++i) {
    std::vector<std::uint8_t> a(address.size());
    for (auto& b : a) b = static_cast<std::uint8_t>(rng());
    a[0] = address[0];  // past the header check: the walk must catch it
    cases.push_back({fmt::format("random bytes {} behind the real header", i), withAddress(a), "UCX worker address"});
    std::vector<std::uint8_t> r(1 + rng() % 300);
    for (auto& b : r) b = static_cast<std::uint8_t>(rng());
    r[0] = static_cast<std::uint8_t>(address[0] ^ 0x0f);
    cases.push_back({fmt::format("random bytes {}", i), withAddress(r), "UCX worker address"});
  }
  {
    std::vector<std::uint8_t> huge(60 * 1024, 0x11);  // under the decoder's cap, far over any address
    huge[0] = address[0];
    cases.push_back({"huge address", withAddress(huge), "UCX worker address"});
  }
  {
    auto k = rkey;
    k[0] ^= 0x40;  // a memory domain this UCX does not have
    cases.push_back({"rkey md map", withRkey(k), "UCX remote key"});
    k = rkey;
    k[8] ^= 0x01;  // memory type
    cases.push_back({"rkey memory type", withRkey(k), "memory type"});
    cases.push_back({"rkey truncated", withRkey({rkey.begin(), rkey.end() - 1}), "UCX remote key"});
    k = rkey;
    k.push_back(7);
    cases.push_back({"rkey trailing byte", withRkey(k), "UCX remote key"});
    cases.push_back({"rkey header only", withRkey({rkey.begin(), rkey.begin() + 4}), "UCX remote key"});
  }
  {
    kvt::KvDescriptor d = good;
    d.transfer_id = kvt::TransferId{};  // no decode transport granted it
    cases.push_back({"no transfer id", d, "no transfer id"});
  }
  {
    kvt::KvDescriptor d = good;
    d.block_ids = {3, 16};  // the pool has 16 blocks
    cases.push_back({"block id past the pool", d, "past the region"});
    d.block_ids = {3, 0xffffffffU};
    cases.push_back({"block id 2^32-1", d, "past the region"});
    d = good;
    d.targets[0].regions[0].block_stride = 1;
    cases.push_back({"block stride below a block", d, "block stride"});
    d = good;
    d.targets[0].regions[0].layer_stride = d.targets[0].regions[0].block_stride;
    cases.push_back({"overlapping layers", d, "overlap"});
  }

  int id = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto r = w.send("POST", worker_api::kPrefillPath,
                    submitJson(fmt::format("cmpl-hostile-{}", id++), prompt, c.descriptor, 5000));
    ASSERT_TRUE(r.ok()) << "the worker did not answer: " << r.error().toString();
    EXPECT_GE(r->status, 400) << r->body;
    EXPECT_LT(r->status, 500) << r->body;
    const Error e = worker_api::parseErrorJson(r->status, r->body);
    EXPECT_EQ(e.code, ErrorCode::InvalidArgument) << e.toString();
    EXPECT_NE(e.message.find(c.needle), std::string::npos) << e.message;
    ASSERT_FALSE(w.process().poll().has_value()) << "the prefill worker died";
  }

  // Still alive and serving: the good descriptor fills the decode pool.
  auto ok = w.send("POST", worker_api::kPrefillPath, submitJson("cmpl-good", prompt, good, 20000));
  ASSERT_TRUE(ok.ok()) << ok.error().toString();
  EXPECT_EQ(ok->status, 200) << ok->body;
  const auto arrived = (*side)->outcomes().waitArrival(100, std::chrono::seconds(20));
  ASSERT_TRUE(arrived.has_value());
  ASSERT_TRUE(arrived->ok()) << arrived->error().toString();
  EXPECT_EQ(arrived->value().num_tokens, n);
  auto health = w.send("GET", "/health");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->status, 200);
}

}  // namespace
}  // namespace pd::prefill::testsupport
