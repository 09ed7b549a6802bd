// The authenticated internal plane: libcrypto primitives, call signing and verification (stale,
// replayed, tampered, unsigned calls), the cluster secret file, and the route wrapper over a real
// HTTP server.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <fstream>
#include <string>

#include "pd/common/crypto.h"
#include "pd/common/http_client.h"
#include "pd/common/http_server.h"
#include "pd/common/internal_auth.h"
#include "pd/common/metrics.h"
#include "pd/common/worker_api.h"
#include "support/test_files.h"

namespace pd {
namespace {

using namespace std::chrono_literals;

std::vector<std::uint8_t> secret(char fill = 's') {
  return std::vector<std::uint8_t>(kMinClusterSecretBytes, static_cast<std::uint8_t>(fill));
}

TEST(Crypto, HmacSha256MatchesRfc4231) {
  const std::string key = "Jefe";
  const crypto::Digest d = crypto::hmacSha256(std::span(reinterpret_cast<const std::uint8_t*>(key.data()), key.size()),
                                              std::string_view("what do ya want for nothing?"));
  EXPECT_EQ(crypto::toHex(d), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(Crypto, HexRoundTripsAndRefusesJunk) {
  const std::vector<std::uint8_t> bytes = {0x00, 0x7f, 0x80, 0xff, 0x12};
  EXPECT_EQ(crypto::toHex(bytes), "007f80ff12");
  EXPECT_EQ(crypto::fromHex("007F80fF12").value(), bytes);
  EXPECT_EQ(crypto::fromHex("abc").error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(crypto::fromHex("zz").error().code, ErrorCode::InvalidArgument);
}

TEST(Crypto, RandomIdsAre128BitsAndDiffer) {
  const std::string a = crypto::randomHex128();
  const std::string b = crypto::randomHex128();
  EXPECT_EQ(a.size(), 32U);
  EXPECT_NE(a, b);
  EXPECT_TRUE(crypto::constantTimeEqual(crypto::fromHex(a).value(), crypto::fromHex(a).value()));
  EXPECT_FALSE(crypto::constantTimeEqual(crypto::fromHex(a).value(), crypto::fromHex(b).value()));
  EXPECT_FALSE(crypto::constantTimeEqual(crypto::fromHex("00").value(), crypto::fromHex("0000").value()));
}

struct FakeClock {
  std::atomic<std::int64_t> ms{1'800'000'000'000};
  std::function<std::int64_t()> fn() {
    return [this] { return ms.load(); };
  }
};

std::shared_ptr<InternalAuth> makeAuth(FakeClock& clock, char fill = 's') {
  InternalAuthOptions o;
  o.secret = secret(fill);
  o.max_skew = 30s;
  o.now_ms = clock.fn();
  return InternalAuth::create(std::move(o)).value();
}

TEST(InternalAuth, ShortSecretIsRefused) {
  InternalAuthOptions o;
  o.secret = std::vector<std::uint8_t>(kMinClusterSecretBytes - 1, 1);
  EXPECT_EQ(InternalAuth::create(std::move(o)).error().code, ErrorCode::InvalidArgument);
}

TEST(InternalAuth, SignedCallVerifiesOnceAndTamperingIsRefused) {
  FakeClock clock;
  auto auth = makeAuth(clock);
  const std::string h = auth->sign("POST", "/v1/internal/prefill", R"({"a":1})");
  EXPECT_EQ(auth->verify("POST", "/v1/internal/prefill", R"({"a":2})", h).error().code, ErrorCode::Unauthenticated)
      << "another body";
  EXPECT_FALSE(auth->verify("POST", "/v1/internal/decode/abort", R"({"a":1})", h).ok()) << "another target";
  EXPECT_FALSE(auth->verify("GET", "/v1/internal/prefill", R"({"a":1})", h).ok()) << "another method";
  ASSERT_TRUE(auth->verify("POST", "/v1/internal/prefill", R"({"a":1})", h).ok());
  const Status replay = auth->verify("POST", "/v1/internal/prefill", R"({"a":1})", h);
  ASSERT_FALSE(replay.ok());
  EXPECT_NE(replay.error().message.find("replay"), std::string::npos) << replay.error().message;
}

TEST(InternalAuth, AnotherSecretUnsignedAndMalformedAreRefused) {
  FakeClock clock;
  auto auth = makeAuth(clock);
  auto other = makeAuth(clock, 'x');
  EXPECT_NE(auth->verify("POST", "/x", "", other->sign("POST", "/x", "")).error().message.find("wrong"),
            std::string::npos);
  EXPECT_NE(auth->verify("POST", "/x", "", "").error().message.find("not signed"), std::string::npos);
  const std::vector<std::string> junks = {"v2 t=1 n=00 s=00", "v1", "v1 t=abc n=0123456789abcdef0123456789abcdef s=00",
                                          std::string("v1 ") + std::string(300, 'a')};
  for (const std::string& junk : junks) {
    const Status s = auth->verify("POST", "/x", "", junk);
    ASSERT_FALSE(s.ok()) << junk;
    EXPECT_EQ(s.error().code, ErrorCode::Unauthenticated);
    EXPECT_EQ(s.error().message.find(junk), std::string::npos) << "the header is never echoed";
  }
}

TEST(InternalAuth, StaleAndFutureCallsAreRefused) {
  FakeClock clock;
  auto auth = makeAuth(clock);
  const std::string h = auth->sign("POST", "/x", "b");
  clock.ms += 31'000;
  const Status stale = auth->verify("POST", "/x", "b", h);
  ASSERT_FALSE(stale.ok());
  EXPECT_NE(stale.error().message.find("timestamp"), std::string::npos);
  const std::string fresh = auth->sign("POST", "/x", "b");
  clock.ms -= 62'000;  // the receiver's clock is now far behind the sender's
  EXPECT_FALSE(auth->verify("POST", "/x", "b", fresh).ok());
  clock.ms += 40'000;  // 22 s behind the sender: within the window again
  EXPECT_TRUE(auth->verify("POST", "/x", "b", fresh).ok());
}

TEST(InternalAuth, BlobTagsBindPurposeAndBytes) {
  FakeClock clock;
  auto auth = makeAuth(clock);
  const std::string blob = "descriptor bytes";
  const auto bytes = std::as_bytes(std::span(blob.data(), blob.size()));
  const crypto::Digest t = auth->tag("descriptor", bytes);
  EXPECT_TRUE(auth->checkTag("descriptor", bytes, t));
  EXPECT_FALSE(auth->checkTag("record", bytes, t));
  const std::string other = "descriptor bytez";
  EXPECT_FALSE(auth->checkTag("descriptor", std::as_bytes(std::span(other.data(), other.size())), t));
  EXPECT_FALSE(auth->checkTag("descriptor", bytes, std::span(t.data(), 31)));
}

TEST(ClusterSecret, LoadsWritesAndRefusesWithoutEchoing) {
  test::TempDir dir;
  const auto file = dir.path() / "secret";
  EXPECT_EQ(loadClusterSecret(file).error().code, ErrorCode::NotFound);
  { std::ofstream(file) << "short-and-secret\n"; }
  const auto short_one = loadClusterSecret(file);
  ASSERT_FALSE(short_one.ok());
  EXPECT_EQ(short_one.error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(short_one.error().message.find("short-and-secret"), std::string::npos);
  ASSERT_TRUE(writeNewClusterSecret(file).ok());
  struct stat st {};
  ASSERT_EQ(::stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600U);
  const auto loaded = loadClusterSecret(file);
  ASSERT_TRUE(loaded.ok()) << loaded.error().toString();
  EXPECT_EQ(loaded->size(), 64U) << "32 random bytes as hex, newline dropped";
  ASSERT_TRUE(writeNewClusterSecret(file).ok());
  EXPECT_NE(loadClusterSecret(file).value(), loaded.value()) << "a new secret each time";
}

// The placeholder deploy/base/cluster-secret ships with, and secrets of a few repeated characters,
// are refused: a cluster must not start with a guessable secret.
TEST(ClusterSecret, RefusesPlaceholdersAndRepeatedCharacters) {
  test::TempDir dir;
  const auto file = dir.path() / "secret";
  for (const std::string& text : std::vector<std::string>{
           "REPLACE-ME-pdserve-refuses-this-placeholder-write-openssl-rand-hex-32-here",
           "changeme-changeme-changeme-changeme", std::string(48, 'x'), "abcabcabcabcabcabcabcabcabcabcabcabc"}) {
    { std::ofstream(file) << text << "\n"; }
    const auto refused = loadClusterSecret(file);
    ASSERT_FALSE(refused.ok()) << text;
    EXPECT_EQ(refused.error().code, ErrorCode::InvalidArgument);
    EXPECT_NE(refused.error().message.find("placeholder"), std::string::npos) << refused.error().message;
    EXPECT_EQ(refused.error().message.find(text), std::string::npos) << "never echoes the file";
  }
}

TEST(RequireInternalAuth, RealServerRefusesUnsignedAndReplayedCallsAndCountsThem) {
  InternalAuthOptions o;
  o.secret = secret();
  auto auth = InternalAuth::create(std::move(o)).value();
  metrics::Registry registry;
  std::atomic<int> served{0};
  std::vector<http::Route> routes;
  routes.push_back({"POST", "/v1/internal/prefill", [&](http::Request, http::Exchange ex) {
                      ++served;
                      ex.respond(http::Response::withBody(200, "application/json", "{}"));
                    }});
  routes.push_back({"GET", "/health", [](http::Request, http::Exchange ex) {
                      ex.respond(http::Response::withBody(200, "text/plain", "ok"));
                    }});
  auto server = http::Server::start({}, requireInternalAuth(std::move(routes), auth, &registry)).value();
  http::Client client("127.0.0.1", server->port());

  http::ClientRequest unsigned_call{"POST", "/v1/internal/prefill", {{"Content-Type", "application/json"}}, "{}"};
  auto r = client.send(unsigned_call, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(worker_api::parseErrorJson(r->status, r->body).code, ErrorCode::Unauthenticated);

  http::ClientRequest signed_call = unsigned_call;
  signRequest(auth.get(), signed_call.method, signed_call.target, signed_call.body, signed_call.headers);
  r = client.send(signed_call, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200);
  r = client.send(signed_call, 5s);  // the same bytes again: a replay
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(served.load(), 1);

  http::ClientRequest probe{"GET", "/health", {}, ""};
  r = client.send(probe, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200) << "probes stay open for orchestrators";

  auto& rejected = registry.counter("pdserve_internal_auth_rejected_total", "", {"reason"});
  EXPECT_EQ(rejected.labels({"unsigned"}).value(), 1.0);
  EXPECT_EQ(rejected.labels({"replay"}).value(), 1.0);
  server->stop();
}

}  // namespace
}  // namespace pd
