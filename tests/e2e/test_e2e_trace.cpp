// One request's trace through `pdserve up` (real router, prefill and decode processes, real HTTP
// and UCX), collected by the test's OTLP/HTTP receiver: the client's traceparent is continued by
// the router, and the router's legs carry it on to both workers, so every span shares the
// client's trace id with the right parents. The router's phases (validate, template, tokenize,
// route, decode leg) follow one another without gaps and sum to the end-to-end time the client
// measured, within 5 %. A malformed traceparent starts a new trace. `up` is stopped (SIGTERM: every
// exporter flushes on the way out) before the spans are read, so nothing waits on a timer.
// A second case runs chats on a decode pool too small for them: a preempted and resumed request
// is still one trace, with the decode.preempted, router.resume and decode.kv_record spans in place.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/trace/trace_context.h"
#include "support/local_cluster.h"
#include "support/otlp_receiver.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;

struct Streamed {
  int status = 0;
  bool done = false;
  std::int64_t completion_tokens = 0;
  double e2e_ms = 0;  ///< request sent -> [DONE] read, on the client's steady clock
};

Streamed streamChat(const LocalCluster& cluster, const std::string& traceparent, int max_tokens,
                    const std::string& question = "Tell me about the sea.") {
  json::object body{{"model", "pdserve-default"},
                    {"messages", json::array{json::object{{"role", "user"}, {"content", question}}}},
                    {"max_tokens", max_tokens},
                    {"ignore_eos", true},
                    {"stream", true},
                    {"stream_options", json::object{{"include_usage", true}}}};
  http::Client client(cluster.host(), cluster.port());
  http::ClientRequest req{
      "POST", "/v1/chat/completions", {{"Content-Type", "application/json"}}, json::serialize(body)};
  if (!traceparent.empty()) req.headers.push_back({std::string(trace::kTraceparentHeader), traceparent});
  Streamed out;
  // The connection is made first (a keep-alive GET /health), so the timed call is the request alone.
  auto health = client.send({"GET", "/health", {}, {}}, 30s);
  EXPECT_TRUE(health.ok() && health->status == 200);
  const auto start = std::chrono::steady_clock::now();
  auto r = client.streamEvents(req, 120s, [&](const http::SseEvent& event) {
    if (event.data == "[DONE]") {
      out.done = true;
      return true;
    }
    const auto doc = json::parse(event.data);
    if (const auto* usage = doc.as_object().if_contains("usage"); usage != nullptr && usage->is_object()) {
      out.completion_tokens = usage->at("completion_tokens").to_number<std::int64_t>();
    }
    return true;
  });
  out.e2e_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().toString());
  if (r.ok()) out.status = r->status;
  return out;
}

/// The spans of one trace, by name (each name must occur once).
class TraceView {
 public:
  TraceView(const std::vector<ReceivedSpan>& all, const std::string& trace_id) {
    for (const auto& s : all) {
      if (s.trace_id == trace_id) spans_.push_back(s);
    }
  }
  [[nodiscard]] const std::vector<ReceivedSpan>& spans() const { return spans_; }
  [[nodiscard]] std::size_t count(const std::string& name) const {
    std::size_t n = 0;
    for (const auto& s : spans_) n += s.name == name ? 1 : 0;
    return n;
  }
  [[nodiscard]] std::vector<const ReceivedSpan*> all(const std::string& name) const {
    std::vector<const ReceivedSpan*> out;
    for (const auto& s : spans_) {
      if (s.name == name) out.push_back(&s);
    }
    return out;
  }
  [[nodiscard]] const ReceivedSpan* byId(const std::string& span_id) const {
    for (const auto& s : spans_) {
      if (s.span_id == span_id) return &s;
    }
    return nullptr;
  }
  [[nodiscard]] const ReceivedSpan& one(const std::string& name) const {
    EXPECT_EQ(count(name), 1u) << name;
    for (const auto& s : spans_) {
      if (s.name == name) return s;
    }
    static const ReceivedSpan kNone;
    return kNone;
  }

 private:
  std::vector<ReceivedSpan> spans_;
};

TEST(E2eTrace, OneTraceFromTheClientThroughRouterPrefillAndDecodeWithPhasesThatAddUp) {
  TempDir cache;
  OtlpReceiver receiver;
  auto cluster = std::make_unique<LocalCluster>(
      std::vector<std::string>{"--model.cache_dir=" + cache.path().string(), "--router.port=0", "--log.level=warn",
                               "--trace.otlp_url=" + receiver.url(), "--trace.sample_ratio=1"});
  ASSERT_FALSE(cluster->url().empty());

  // The client's own span: the router continues its trace.
  const trace::SpanContext client{trace::newTraceId(), trace::newSpanId(), trace::kSampledFlag};
  const Streamed traced = streamChat(*cluster, trace::formatTraceparent(client), 384);
  ASSERT_EQ(traced.status, 200);
  ASSERT_TRUE(traced.done);
  EXPECT_EQ(traced.completion_tokens, 384);
  // Upper-case hex is not W3C: ignored, and the router starts a trace of its own.
  const std::string malformed = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01";
  const Streamed fresh = streamChat(*cluster, malformed, 4);
  ASSERT_EQ(fresh.status, 200);

  EXPECT_EQ(cluster->stop(120s), 0);  // every process flushes its exporter on the way out
  cluster.reset();
  const auto all = receiver.spans();
  EXPECT_EQ(receiver.bad_requests(), 0);

  const TraceView t(all, client.trace_id.hex());
  const ReceivedSpan& request = t.one("router.request");
  EXPECT_EQ(request.service, "pdserve-router");
  EXPECT_EQ(request.parent_span_id, client.span_id.hex());
  EXPECT_EQ(request.attributes.count("pd.request_id"), 1u);
  EXPECT_EQ(request.attributes.at("http.response.status_code"), "200");
  for (const char* child : {"router.validate", "router.template", "router.tokenize", "router.route",
                            "router.decode_leg", "router.prefill_leg", "router.stream"}) {
    EXPECT_EQ(t.one(child).parent_span_id, request.span_id) << child;
    EXPECT_EQ(t.one(child).service, "pdserve-router") << child;
    EXPECT_FALSE(t.one(child).error) << child;
  }
  const ReceivedSpan& decode_leg = t.one("router.decode_leg");
  const ReceivedSpan& prefill_leg = t.one("router.prefill_leg");
  const ReceivedSpan& prefill = t.one("prefill.request");
  const ReceivedSpan& decode = t.one("decode.request");
  EXPECT_EQ(prefill.service, "pdserve-prefill");
  EXPECT_EQ(decode.service, "pdserve-decode");
  EXPECT_EQ(prefill.parent_span_id, prefill_leg.span_id);
  EXPECT_EQ(decode.parent_span_id, decode_leg.span_id);
  EXPECT_EQ(decode.attributes.at("pd.completion_tokens"), "384");
  // Every span of the trace hangs off a span of the trace (or, for the root, the client's).
  std::map<std::string, const ReceivedSpan*> by_id;
  for (const auto& s : t.spans()) by_id[s.span_id] = &s;
  for (const auto& s : t.spans()) {
    EXPECT_TRUE(by_id.contains(s.parent_span_id) || &s == &request) << s.name << " has an unknown parent";
  }
  EXPECT_GE(t.spans().size(), 16u);  // 8 router spans, and the workers' phases

  // The phases tile the request: each starts where the previous one ended...
  const ReceivedSpan& validate = t.one("router.validate");
  const ReceivedSpan& templ = t.one("router.template");
  const ReceivedSpan& tokenize = t.one("router.tokenize");
  const ReceivedSpan& route = t.one("router.route");
  EXPECT_EQ(validate.start_ns, request.start_ns);
  EXPECT_EQ(templ.start_ns, validate.end_ns);
  EXPECT_EQ(tokenize.start_ns, templ.end_ns);
  EXPECT_EQ(route.start_ns, tokenize.end_ns);
  EXPECT_EQ(decode_leg.start_ns, route.end_ns);
  EXPECT_LE(decode_leg.end_ns, request.end_ns);
  // ...the prefill leg and the stream lie inside the request...
  EXPECT_GE(prefill_leg.start_ns, decode_leg.start_ns);
  EXPECT_LE(prefill_leg.end_ns, decode_leg.end_ns);
  EXPECT_GE(t.one("router.stream").start_ns, prefill_leg.start_ns);
  EXPECT_LE(t.one("router.stream").end_ns, request.end_ns);
  // ...and together they are the end-to-end time the client saw, within 5 %.
  const double phases = validate.ms() + templ.ms() + tokenize.ms() + route.ms() + decode_leg.ms();
  std::fprintf(stderr, "router phases %.3f ms, router.request %.3f ms, client end-to-end %.3f ms\n", phases,
               request.ms(), traced.e2e_ms);
  EXPECT_LE(request.ms(), traced.e2e_ms);
  EXPECT_NEAR(phases, traced.e2e_ms, 0.05 * traced.e2e_ms)
      << "validate " << validate.ms() << " template " << templ.ms() << " tokenize " << tokenize.ms() << " route "
      << route.ms() << " decode leg " << decode_leg.ms() << " request " << request.ms();

  // The malformed header: a new trace rooted at the router, which the workers still join.
  const ReceivedSpan* root = nullptr;
  for (const auto& s : all) {
    if (s.name == "router.request" && s.trace_id != client.trace_id.hex()) {
      EXPECT_EQ(root, nullptr) << "two new traces";
      root = &s;
    }
  }
  ASSERT_NE(root, nullptr);
  EXPECT_TRUE(root->parent_span_id.empty());
  EXPECT_NE(root->trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
  const TraceView other(all, root->trace_id);
  EXPECT_EQ(other.count("prefill.request"), 1u);
  EXPECT_EQ(other.count("decode.request"), 1u);
}

// The value of `series` (its full name with labels) in the router's /metrics; 0 when absent.
double routerMetric(const LocalCluster& cluster, const std::string& series) {
  http::Client client(cluster.host(), cluster.port());
  auto r = client.send({"GET", "/metrics", {}, {}}, 10s);
  if (!r.ok() || r->status != 200) return -1;
  const std::string& text = r->body;
  for (std::size_t at = text.find(series); at != std::string::npos; at = text.find(series, at + 1)) {
    if ((at == 0 || text[at - 1] == '\n') && text.size() > at + series.size() && text[at + series.size()] == ' ') {
      return std::stod(text.substr(at + series.size() + 1));
    }
  }
  return 0;
}

// A decode pool too small for the chats sent at once (docs/kv-memory.md): the decode worker
// preempts some, the router resumes them, and each such request is still one trace (the
// client's) across the three processes: the decode worker's decode.preempted hangs under the
// preempted leg's decode.request, the router's router.resume under router.request with the
// resumed legs as its children, and every decode.kv_record under the prefill worker's
// prefill.completion named by the KV completion record, linked to its decode.request. The
// chats are all answered and the router has counted its resumes before `up` is stopped (every
// exporter flushes on the way out), so nothing here waits on a timer.
TEST(E2eTrace, APreemptedAndResumedRequestIsOneTraceWithItsPreemptionAndResume) {
  TempDir cache;
  OtlpReceiver receiver;
  // 28 blocks of 4 tokens with 2 kept free at admission: about two of these chats (some 10
  // prompt tokens + 48) at their full length, while admission lets in more.
  auto cluster = std::make_unique<LocalCluster>(
      std::vector<std::string>{"--model.cache_dir=" + cache.path().string(), "--router.port=0", "--log.level=warn",
                               "--trace.otlp_url=" + receiver.url(), "--trace.sample_ratio=1", "--decode.block_size=4",
                               "--decode.num_blocks=28", "--decode.kv_headroom_blocks=2", "--decode.kv_dtype=f32"});
  ASSERT_FALSE(cluster->url().empty());

  const std::vector<std::string> questions = {"What is a river?",       "Tell me about music.", "What is a dog?",
                                              "Tell me about the sea.", "What is a city?",      "Tell me about trees.",
                                              "What is a mountain?",    "What is rain?"};
  constexpr int kTokens = 48;
  std::vector<trace::SpanContext> clients;
  for (std::size_t i = 0; i < questions.size(); ++i) {
    clients.push_back({trace::newTraceId(), trace::newSpanId(), trace::kSampledFlag});
  }
  std::vector<Streamed> results(questions.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < questions.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = streamChat(*cluster, trace::formatTraceparent(clients[i]), kTokens, questions[i]); });
  }
  for (auto& t : threads) t.join();
  for (std::size_t i = 0; i < results.size(); ++i) {
    EXPECT_EQ(results[i].status, 200) << "chat " << i;
    EXPECT_TRUE(results[i].done) << "chat " << i;
    EXPECT_EQ(results[i].completion_tokens, kTokens) << "chat " << i;
  }
  const double resumes = routerMetric(*cluster, "pdserve_router_resumes_total{cause=\"preempted\"}");
  std::fprintf(stderr, "%zu chats, %.0f resumed after a preemption\n", questions.size(), resumes);
  ASSERT_GT(resumes, 0) << "the pool never ran dry: the test proves nothing";

  EXPECT_EQ(cluster->stop(120s), 0);  // every process flushes its exporter on the way out
  cluster.reset();
  const auto all = receiver.spans();
  EXPECT_EQ(receiver.bad_requests(), 0);

  int preempted_traces = 0;
  for (const trace::SpanContext& client : clients) {
    const TraceView t(all, client.trace_id.hex());
    const auto preemptions = t.all("decode.preempted");
    if (preemptions.empty()) continue;
    ++preempted_traces;
    const std::string what = "trace " + client.trace_id.hex();
    // One trace id across the three processes.
    std::set<std::string> services;
    for (const auto& s : t.spans()) services.insert(s.service);
    EXPECT_EQ(services, (std::set<std::string>{"pdserve-router", "pdserve-prefill", "pdserve-decode"})) << what;
    const ReceivedSpan& request = t.one("router.request");
    EXPECT_EQ(request.parent_span_id, client.span_id.hex()) << what;
    for (const auto& s : t.spans()) {
      EXPECT_TRUE(&s == &request || t.byId(s.parent_span_id) != nullptr)
          << what << ": " << s.name << " has a parent outside the trace";
    }

    // decode.preempted: under the preempted leg's decode.request, with what it gave up.
    for (const ReceivedSpan* p : preemptions) {
      const ReceivedSpan* leg = t.byId(p->parent_span_id);
      ASSERT_NE(leg, nullptr) << what;
      EXPECT_EQ(leg->name, "decode.request") << what;
      EXPECT_EQ(p->service, "pdserve-decode");
      EXPECT_EQ(p->attributes.at("pd.reason"), "kv_pool_exhausted") << what;
      EXPECT_GE(std::stoll(p->attributes.at("pd.blocks_freed")), 1) << what;
      EXPECT_GE(std::stoll(p->attributes.at("pd.completion_tokens")), 0) << what;
      EXPECT_EQ(leg->attributes.at("pd.finish_reason"), "abort") << what;
    }

    // router.resume: under router.request; the legs it opened are its children.
    const auto resumes_here = t.all("router.resume");
    ASSERT_GE(resumes_here.size(), 1u) << what;
    EXPECT_LE(resumes_here.size(), preemptions.size()) << what;
    std::set<std::string> attempts;
    for (const ReceivedSpan* r : resumes_here) {
      EXPECT_EQ(r->parent_span_id, request.span_id) << what;
      EXPECT_EQ(r->service, "pdserve-router");
      EXPECT_EQ(r->attributes.at("pd.cause"), "preempted") << what;
      const auto carried = std::stoll(r->attributes.at("pd.tokens_carried"));
      EXPECT_GE(carried, 0) << what;
      EXPECT_LT(carried, kTokens) << what;
      attempts.insert(r->attributes.at("pd.attempt"));
      int decode_legs = 0;
      int prefill_legs = 0;
      for (const auto& s : t.spans()) {
        if (s.parent_span_id != r->span_id) continue;
        decode_legs += s.name == "router.decode_leg" ? 1 : 0;
        prefill_legs += s.name == "router.prefill_leg" ? 1 : 0;
        EXPECT_GE(s.start_ns, r->start_ns) << what << ": " << s.name << " starts before its resume";
      }
      EXPECT_GE(decode_legs, 1) << what;
      EXPECT_GE(prefill_legs, 1) << what;
    }
    EXPECT_EQ(attempts.size(), resumes_here.size()) << what << ": each resume has its own number";
    EXPECT_TRUE(attempts.contains("1")) << what;
    // The first legs hang under router.request itself.
    bool first_leg = false;
    for (const ReceivedSpan* leg : t.all("router.decode_leg")) {
      first_leg = first_leg || (leg->parent_span_id == request.span_id && leg->attributes.at("pd.attempt") == "0");
    }
    EXPECT_TRUE(first_leg) << what;

    // The KV completion record's span link: each decode.kv_record is a child of the prefill
    // worker's prefill.completion and links the decode.request that received the record. The
    // resumed leg's record is among them.
    const auto records = t.all("decode.kv_record");
    EXPECT_GE(records.size(), 1u) << what;
    bool resumed_record = false;  // the record of a leg opened by a resume
    for (const ReceivedSpan* k : records) {
      EXPECT_EQ(k->service, "pdserve-decode");
      const ReceivedSpan* completion = t.byId(k->parent_span_id);
      ASSERT_NE(completion, nullptr) << what;
      EXPECT_EQ(completion->name, "prefill.completion") << what;
      EXPECT_EQ(completion->service, "pdserve-prefill");
      ASSERT_EQ(k->links.size(), 1u) << what;
      EXPECT_EQ(k->links[0].first, client.trace_id.hex()) << what;
      const ReceivedSpan* decode = t.byId(k->links[0].second);
      ASSERT_NE(decode, nullptr) << what;
      EXPECT_EQ(decode->name, "decode.request") << what;
      EXPECT_GE(k->start_ns, completion->start_ns) << what;
      const ReceivedSpan* leg = t.byId(decode->parent_span_id);
      ASSERT_NE(leg, nullptr) << what;
      const ReceivedSpan* above = t.byId(leg->parent_span_id);
      resumed_record = resumed_record || (above != nullptr && above->name == "router.resume");
    }
    EXPECT_TRUE(resumed_record) << what << ": no completion record reached a resumed leg";
  }
  std::fprintf(stderr, "%d of %zu traces hold a preemption\n", preempted_traces, clients.size());
  EXPECT_GT(preempted_traces, 0);
}

}  // namespace
}  // namespace pd::test
