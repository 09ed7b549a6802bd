// The authenticated internal plane on a real `pdserve prefill` process started with a cluster
// secret (docs/security.md): unsigned, wrongly signed and replayed calls get 401 and are
// counted; a KV descriptor without its decode worker's tag never reaches the decoder or UCX; the
// probes stay open; a correctly signed call with a tagged descriptor is served, and the worker
// stays alive through all of it.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "integration/prefill_worker_util.h"
#include "pd/common/crypto.h"
#include "pd/common/http_client.h"
#include "pd/common/internal_auth.h"
#include "pd/common/worker_api.h"
#include "support/test_files.h"

namespace pd::prefill::testsupport {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

fs::path goldenModel() {
  return fs::path(PD_TEST_DATA_DIR) / "golden" / "tiny-bf16";
}

std::shared_ptr<InternalAuth> authFor(const fs::path& secret_file) {
  auto auth = loadInternalAuth(secret_file);
  EXPECT_TRUE(auth.ok());
  return auth.ok() ? *auth : nullptr;
}

/// A submission whose descriptor is tagged with `tagger` (none when null).
std::string taggedSubmit(const std::string& id, const kvt::KvDescriptor& d, const InternalAuth* tagger) {
  auto parsed = worker_api::parsePrefillSubmit(submitJson(id, {5, 6, 7, 8, 9}, d, 30000));
  EXPECT_TRUE(parsed.ok());
  worker_api::PrefillSubmit s = *parsed;
  if (tagger != nullptr) {
    const std::string& raw = s.kv_descriptor;
    s.kv_descriptor_tag = crypto::toHex(tagger->tag("descriptor", std::as_bytes(std::span(raw.data(), raw.size()))));
  }
  return worker_api::toJson(s);
}

http::ClientResponse post(const WorkerProcess& w, const std::string& body, const InternalAuth* signer) {
  http::Client client(w.host(), w.port());
  http::ClientRequest r{"POST", std::string(worker_api::kPrefillPath), {{"Content-Type", "application/json"}}, body};
  signRequest(signer, r.method, r.target, r.body, r.headers);
  auto response = client.send(r, 30s);
  EXPECT_TRUE(response.ok()) << (response.ok() ? "" : response.error().toString());
  return response.ok() ? *response : http::ClientResponse{};
}

TEST(InternalAuthWorkers, PrefillWorkerRefusesForgedCallsAndDescriptorsAndServesSignedOnes) {
  test::TempDir dir;
  const fs::path secret = dir.path() / "secret";
  const fs::path other_secret = dir.path() / "other";
  ASSERT_TRUE(writeNewClusterSecret(secret).ok());
  ASSERT_TRUE(writeNewClusterSecret(other_secret).ok());
  const auto auth = authFor(secret);
  const auto other = authFor(other_secret);
  ASSERT_TRUE(auth && other);

  auto side = DecodeSide::create(goldenModel(), 64, 16, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  WorkerProcess w(
      {"--model.path", goldenModel().string(), "--prefill.threads", "1", "--cluster.secret_file", secret.string()});
  ASSERT_TRUE(w.ok());

  const kvt::KvDescriptor d = (*side)->expect(41, 5, {3}, 30s);
  // Unsigned, and signed with another cluster's secret: 401 before anything is parsed.
  for (const InternalAuth* signer : std::vector<const InternalAuth*>{nullptr, other.get()}) {
    const auto r = post(w, taggedSubmit("cmpl-forged", d, auth.get()), signer);
    EXPECT_EQ(r.status, 401) << r.body;
    EXPECT_EQ(worker_api::parseErrorJson(r.status, r.body).code, ErrorCode::Unauthenticated);
  }
  // A signed call whose descriptor was not made by a decode worker of this cluster.
  for (const InternalAuth* tagger : std::vector<const InternalAuth*>{nullptr, other.get()}) {
    const auto r = post(w, taggedSubmit("cmpl-untagged", d, tagger), auth.get());
    EXPECT_EQ(r.status, 401) << r.body;
    EXPECT_NE(r.body.find("not signed by a decode worker"), std::string::npos) << r.body;
  }
  // Probes stay open; the status is internal.
  EXPECT_EQ(w.send("GET", "/health")->status, 200);
  EXPECT_EQ(w.send("GET", worker_api::kStatusPath)->status, 401);

  // The real thing: signed, tagged. It fills the decode side's blocks; its replay is refused.
  http::Client client(w.host(), w.port());
  http::ClientRequest good{"POST",
                           std::string(worker_api::kPrefillPath),
                           {{"Content-Type", "application/json"}},
                           taggedSubmit("cmpl-good", d, auth.get())};
  signRequest(auth.get(), good.method, good.target, good.body, good.headers);
  auto served = client.send(good, 30s);
  ASSERT_TRUE(served.ok());
  EXPECT_EQ(served->status, 200) << served->body;
  const auto arrived = (*side)->outcomes().waitArrival(41, kvt::testutil::kHangGuard);
  ASSERT_TRUE(arrived.has_value());
  EXPECT_TRUE(arrived->ok()) << arrived->error().toString();
  auto replayed = client.send(good, 30s);
  ASSERT_TRUE(replayed.ok());
  EXPECT_EQ(replayed->status, 401) << replayed->body;

  // pdserve_internal_auth_rejected_total{reason="..."} summed over its reasons.
  const auto metrics = w.send("GET", "/metrics");
  ASSERT_TRUE(metrics.ok());
  double rejected = 0;
  const std::string key = "pdserve_internal_auth_rejected_total{";
  for (std::size_t pos = metrics->body.find(key); pos != std::string::npos; pos = metrics->body.find(key, pos + 1)) {
    const std::size_t space = metrics->body.find(' ', pos);
    rejected += std::stod(metrics->body.substr(space + 1, metrics->body.find('\n', space) - space - 1));
  }
  EXPECT_GE(rejected, 4.0) << "unsigned, wrong secret, the status poll and the replay";
  EXPECT_EQ(w.send("GET", "/ready")->status, 200) << "the worker is alive and ready";
}

}  // namespace
}  // namespace pd::prefill::testsupport
