// The router's one log line per finished request, through `pdserve up` (real processes), in both
// log formats: in text by default, with the ids, tokens, latencies, phases and workers and never
// the prompt; with --log.format json every line up prints on stderr (its own and its children's)
// is one JSON object, and --router.log_prompts adds the prompt to the request's line. The test waits
// for the request's line (written once both legs are over), then stops `up` and reads its log.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/trace/trace_context.h"
#include "support/local_cluster.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;

constexpr std::string_view kMarker = "zebra-marker-4711";

struct Answer {
  int status = 0;
  std::string request_id;
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;
};

Answer chat(const LocalCluster& cluster, const std::string& traceparent) {
  const json::object body{
      {"model", "pdserve-default"},
      {"messages", json::array{json::object{{"role", "user"}, {"content", std::string(kMarker) + " tell me a story"}}}},
      {"max_tokens", 6},
      {"ignore_eos", true}};
  http::Client client(cluster.host(), cluster.port());
  http::ClientRequest req{"POST",
                          "/v1/chat/completions",
                          {{"Content-Type", "application/json"}, {std::string(trace::kTraceparentHeader), traceparent}},
                          json::serialize(body)};
  auto r = client.send(req, 120s);
  Answer a;
  if (!r.ok()) {
    ADD_FAILURE() << r.error().toString();
    return a;
  }
  a.status = r->status;
  for (const auto& h : r->headers) {
    if (http::equalsIgnoreCase(h.name, "X-Request-Id")) a.request_id = h.value;
  }
  if (a.status == 200) {
    const auto usage = json::parse(r->body).at("usage");
    a.prompt_tokens = usage.at("prompt_tokens").to_number<std::int64_t>();
    a.completion_tokens = usage.at("completion_tokens").to_number<std::int64_t>();
  }
  return a;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string all;
  for (const auto& l : lines) all += l + "\n";
  return all;
}

/// Waits until up's stderr has a line containing `needle` (the router writes a request's line once
/// both legs are over, which may be after the client has its answer); false after `timeout`.
bool waitForLine(const LocalCluster& cluster, std::string_view needle, std::chrono::seconds timeout = 60s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    for (const auto& l : cluster.stderrLines()) {
      if (l.find(needle) != std::string::npos) return true;
    }
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

std::vector<std::string> baseFlags(const TempDir& cache) {
  return {"--model.cache_dir=" + cache.path().string(), "--router.port=0", "--log.level=info"};
}

TEST(E2eRequestLog, TextLineHasTheRequestsFiguresAndNoPrompt) {
  TempDir cache;
  auto cluster = std::make_unique<LocalCluster>(baseFlags(cache), 180s, /*capture_stderr=*/true);
  ASSERT_FALSE(cluster->url().empty());
  // Tracing is off here: the router passes the client's context through, and logs its trace id.
  const trace::SpanContext client{trace::newTraceId(), trace::newSpanId(), trace::kSampledFlag};
  const Answer a = chat(*cluster, trace::formatTraceparent(client));
  ASSERT_EQ(a.status, 200);
  ASSERT_FALSE(a.request_id.empty());
  // Stopping now could cut a prefill answer still on its way (the line would lack its figures).
  EXPECT_TRUE(waitForLine(*cluster, "[router] request id=" + a.request_id));
  EXPECT_EQ(cluster->stop(120s), 0);
  const auto lines = cluster->stderrLines();
  cluster.reset();

  std::vector<std::string> request_lines;
  for (const auto& l : lines) {
    EXPECT_EQ(l.find(kMarker), std::string::npos) << "the prompt reached the log: " << l;
    if (l.find("[router] request id=") != std::string::npos) request_lines.push_back(l);
  }
  ASSERT_EQ(request_lines.size(), 1u) << joined(lines);
  const std::string& line = request_lines.front();
  for (const std::string& want : {" id=" + a.request_id + " ",
                                  " trace_id=" + client.trace_id.hex() + " ",
                                  std::string(" model=pdserve-default "),
                                  std::string(" status=200 "),
                                  std::string(" outcome=ok "),
                                  std::string(" finish_reason=length "),
                                  " prompt_tokens=" + std::to_string(a.prompt_tokens) + " ",
                                  std::string(" cached_tokens="),
                                  std::string(" completion_tokens=6 "),
                                  std::string(" ttft_ms="),
                                  std::string(" tpot_ms="),
                                  std::string(" validate_ms="),
                                  std::string(" template_ms="),
                                  std::string(" tokenize_ms="),
                                  std::string(" route_ms="),
                                  std::string(" decode_open_ms="),
                                  std::string(" prefill_queue_ms="),
                                  std::string(" prefill_compute_ms="),
                                  std::string(" prefill_transfer_ms="),
                                  std::string(" stream_ms="),
                                  std::string(" prefill_worker=127.0.0.1:"),
                                  std::string(" decode_worker=127.0.0.1:")}) {
    EXPECT_NE(line.find(want), std::string::npos) << "'" << want << "' missing in: " << line;
  }
  EXPECT_EQ(line.find(" prompt="), std::string::npos) << line;
}

TEST(E2eRequestLog, JsonModeMakesEveryLineAnObjectAndLogsThePromptOnlyWhenAsked) {
  TempDir cache;
  auto flags = baseFlags(cache);
  flags.insert(flags.end(), {"--log.format=json", "--router.log_prompts=true"});
  auto cluster = std::make_unique<LocalCluster>(flags, 180s, /*capture_stderr=*/true);
  ASSERT_FALSE(cluster->url().empty());
  const trace::SpanContext client{trace::newTraceId(), trace::newSpanId(), trace::kSampledFlag};
  const Answer a = chat(*cluster, trace::formatTraceparent(client));
  ASSERT_EQ(a.status, 200);
  EXPECT_TRUE(waitForLine(*cluster, R"("msg":"request")"));
  EXPECT_EQ(cluster->stop(120s), 0);
  const auto lines = cluster->stderrLines();
  cluster.reset();

  ASSERT_FALSE(lines.empty());
  std::vector<json::object> requests;
  std::set<std::string> processes;
  for (const auto& l : lines) {
    boost::system::error_code ec;
    const json::value v = json::parse(l, ec);
    ASSERT_FALSE(ec) << "not one JSON object: " << l;
    ASSERT_TRUE(v.is_object()) << l;
    const auto& o = v.as_object();
    EXPECT_TRUE(o.contains("ts") && o.contains("level") && o.contains("component") && o.contains("msg")) << l;
    if (const auto* p = o.if_contains("process")) processes.insert(std::string(p->as_string()));
    if (o.contains("process") && o.at("process") == "router" && o.at("msg") == "request") requests.push_back(o);
  }
  // up's own lines and its children's (router, prefill-0, decode-0), all in the one format.
  EXPECT_TRUE(processes.contains("router") && processes.contains("prefill-0") && processes.contains("decode-0"))
      << joined(lines);
  ASSERT_EQ(requests.size(), 1u) << joined(lines);
  const json::object& r = requests.front();
  EXPECT_EQ(r.at("level"), "info");
  EXPECT_EQ(r.at("id").as_string(), a.request_id);
  EXPECT_EQ(r.at("trace_id").as_string(), client.trace_id.hex());
  EXPECT_EQ(r.at("model"), "pdserve-default");
  EXPECT_EQ(r.at("status").as_int64(), 200);
  EXPECT_EQ(r.at("outcome"), "ok");
  EXPECT_EQ(r.at("prompt_tokens").as_int64(), a.prompt_tokens);
  EXPECT_EQ(r.at("completion_tokens").as_int64(), 6);
  EXPECT_EQ(r.at("cached_tokens").as_int64(), 0);
  for (const char* key :
       {"e2e_ms", "ttft_ms", "tpot_ms", "validate_ms", "template_ms", "tokenize_ms", "route_ms", "decode_open_ms",
        "prefill_ms", "prefill_queue_ms", "prefill_compute_ms", "prefill_transfer_ms", "stream_ms"}) {
    ASSERT_TRUE(r.contains(key)) << key;
    EXPECT_GE(r.at(key).as_double(), 0.0) << key;
  }
  EXPECT_LE(r.at("ttft_ms").as_double(), r.at("e2e_ms").as_double());
  EXPECT_TRUE(std::string(r.at("prefill_worker").as_string()).starts_with("127.0.0.1:"));
  EXPECT_TRUE(std::string(r.at("decode_worker").as_string()).starts_with("127.0.0.1:"));
  // --router.log_prompts: the chat messages, as JSON text.
  ASSERT_TRUE(r.contains("prompt"));
  EXPECT_NE(std::string(r.at("prompt").as_string()).find(kMarker), std::string::npos);
}

}  // namespace
}  // namespace pd::test
