// The span exporter: OTLP JSON shape, the bounded queue's drop counting, and a collector that is
// down or never answers (the request path never waits). Events are ordered by construction: a
// sink or server signals when an export is in progress, never a sleep.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <fstream>
#include <future>
#include <mutex>

#include "pd/common/http_server.h"
#include "pd/trace/exporter.h"
#include "pd/trace/tracer.h"
#include "support/test_files.h"

namespace pd::trace {
namespace {

namespace json = boost::json;

SpanData sampleSpan(std::string name) {
  SpanData s;
  s.context = {newTraceId(), newSpanId(), kSampledFlag};
  s.parent_span_id = newSpanId();
  s.name = std::move(name);
  s.kind = SpanKind::Server;
  s.start = TimePoint(std::chrono::nanoseconds{1'700'000'000'123'456'789});
  s.end = s.start + std::chrono::microseconds{2500};
  s.attributes = {
      {"pd.tokens", std::int64_t{42}}, {"pd.model", std::string("m\"1")}, {"pd.ratio", 0.5}, {"pd.cached", true}};
  return s;
}

TEST(OtlpJson, HasTheExportTraceServiceRequestShape) {
  const SpanData span = sampleSpan("prefill");
  SpanData failed = sampleSpan("decode");
  const SpanContext linked{newTraceId(), newSpanId(), kSampledFlag};
  failed.links = {linked};
  failed.parent_span_id = {};
  failed.error = true;
  failed.status_message = "Timeout: no KV";
  const std::vector<SpanData> spans = {span, failed};
  const json::value doc = json::parse(encodeOtlpJson({"pdserve-prefill", {{"process.pid", std::int64_t{7}}}}, spans));

  const auto& rs = doc.at("resourceSpans").as_array();
  ASSERT_EQ(rs.size(), 1u);
  const auto& rattrs = rs[0].at("resource").at("attributes").as_array();
  EXPECT_EQ(rattrs[0].at("key").as_string(), "service.name");
  EXPECT_EQ(rattrs[0].at("value").at("stringValue").as_string(), "pdserve-prefill");
  EXPECT_EQ(rattrs[1].at("value").at("intValue").as_string(), "7");
  const auto& ss = rs[0].at("scopeSpans").as_array();
  ASSERT_EQ(ss.size(), 1u);
  EXPECT_EQ(ss[0].at("scope").at("name").as_string(), "pdserve");
  const auto& out = ss[0].at("spans").as_array();
  ASSERT_EQ(out.size(), 2u);
  const auto& s0 = out[0].as_object();
  EXPECT_EQ(s0.at("traceId").as_string(), span.context.trace_id.hex());
  EXPECT_EQ(s0.at("spanId").as_string(), span.context.span_id.hex());
  EXPECT_EQ(s0.at("parentSpanId").as_string(), span.parent_span_id.hex());
  EXPECT_EQ(s0.at("name").as_string(), "prefill");
  EXPECT_EQ(s0.at("kind").as_int64(), 2);
  EXPECT_EQ(s0.at("startTimeUnixNano").as_string(), "1700000000123456789");
  EXPECT_EQ(s0.at("endTimeUnixNano").as_string(), "1700000000125956789");
  const auto& attrs = s0.at("attributes").as_array();
  ASSERT_EQ(attrs.size(), 4u);
  EXPECT_EQ(attrs[0].at("value").at("intValue").as_string(), "42");
  EXPECT_EQ(attrs[1].at("value").at("stringValue").as_string(), "m\"1");
  EXPECT_EQ(attrs[2].at("value").at("doubleValue").as_double(), 0.5);
  EXPECT_EQ(attrs[3].at("value").at("boolValue").as_bool(), true);
  EXPECT_TRUE(s0.at("status").as_object().empty());
  EXPECT_FALSE(s0.contains("links"));  // none
  const auto& s1 = out[1].as_object();
  ASSERT_EQ(s1.at("links").as_array().size(), 1u);
  EXPECT_EQ(s1.at("links").at(0).at("traceId").as_string(), linked.trace_id.hex());
  EXPECT_EQ(s1.at("links").at(0).at("spanId").as_string(), linked.span_id.hex());
  EXPECT_FALSE(s1.contains("parentSpanId"));  // a root
  EXPECT_EQ(s1.at("status").at("code").as_int64(), 2);
  EXPECT_EQ(s1.at("status").at("message").as_string(), "Timeout: no KV");
}

// A sink the test controls: the first export blocks until released, and says when it started.
class GateSink final : public SpanSink {
 public:
  [[nodiscard]] std::string_view name() const override { return "gate"; }
  Status exportBatch(std::span<const SpanData> spans) override {
    {
      std::lock_guard lock(mu_);
      received_ += spans.size();
    }
    if (first_) {
      first_ = false;
      entered_.set_value();
      released_.get_future().wait();
    }
    return fail_ ? makeError(ErrorCode::PeerFailed, "down") : okStatus();
  }
  std::size_t received() {
    std::lock_guard lock(mu_);
    return received_;
  }
  std::promise<void> entered_;
  std::promise<void> released_;
  bool fail_ = false;

 private:
  bool first_ = true;
  std::mutex mu_;
  std::size_t received_ = 0;
};

TEST(SpanExporter, DropsAndCountsWhenTheQueueIsFullWhileASinkIsStuck) {
  metrics::Registry registry;
  auto sink_owner = std::make_unique<GateSink>();
  GateSink* sink = sink_owner.get();
  auto entered = sink->entered_.get_future();
  std::vector<std::unique_ptr<SpanSink>> sinks;
  sinks.push_back(std::move(sink_owner));
  ExporterOptions options;
  options.queue_capacity = 8;
  options.max_batch = 1;  // the first span alone wakes the thread
  options.interval = std::chrono::hours{1};
  SpanExporter exporter(std::move(sinks), options, &registry);

  ASSERT_TRUE(exporter.enqueue(sampleSpan("first")));
  entered.wait();  // the exporter thread is now inside the sink, holding nothing
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(exporter.enqueue(sampleSpan("queued")));
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(exporter.enqueue(sampleSpan("dropped")));
  EXPECT_EQ(exporter.droppedQueueFull(), 5u);
  EXPECT_NE(registry.render().find("pdserve_trace_spans_dropped_total{reason=\"queue_full\"} 5"), std::string::npos)
      << registry.render();
  EXPECT_NE(registry.render().find("pdserve_trace_queue_spans 8"), std::string::npos);

  sink->released_.set_value();
  exporter.flush();
  EXPECT_EQ(sink->received(), 9u);
  EXPECT_EQ(exporter.exportedSpans(), 9u);
  EXPECT_NE(registry.render().find("pdserve_trace_spans_exported_total{sink=\"gate\"} 9"), std::string::npos);
}

TEST(SpanExporter, CountsFailedExportsAsDropped) {
  metrics::Registry registry;
  auto sink_owner = std::make_unique<GateSink>();
  sink_owner->fail_ = true;
  sink_owner->released_.set_value();
  std::vector<std::unique_ptr<SpanSink>> sinks;
  sinks.push_back(std::move(sink_owner));
  SpanExporter exporter(std::move(sinks), {}, &registry);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(exporter.enqueue(sampleSpan("x")));
  exporter.flush();
  EXPECT_EQ(exporter.exportedSpans(), 0u);
  EXPECT_GE(exporter.failedExports(), 1u);
  EXPECT_NE(registry.render().find("pdserve_trace_spans_dropped_total{reason=\"export_failed\"} 3"), std::string::npos)
      << registry.render();
}

TEST(SpanExporter, ACollectorThatIsDownCostsTheRequestPathNothing) {
  std::uint16_t dead_port = 0;
  {
    auto server = http::Server::start({}, {});
    ASSERT_TRUE(server.ok());
    dead_port = (*server)->port();
  }  // closed: connections to it are refused
  metrics::Registry registry;
  TraceConfig cfg;
  cfg.otlp_url = "http://127.0.0.1:" + std::to_string(dead_port);
  auto tracer = Tracer::create(cfg, "pdserve-test", &registry);
  ASSERT_TRUE(tracer.ok()) << tracer.error().toString();
  ASSERT_TRUE((*tracer)->enabled());
  for (int i = 0; i < 100; ++i) {
    Span s = (*tracer)->startSpan("request", std::nullopt, SpanKind::Server);
    EXPECT_TRUE(s.recording());
  }
  (*tracer)->exporter()->flush();
  EXPECT_EQ((*tracer)->exporter()->exportedSpans(), 0u);
  EXPECT_NE(registry.render().find("pdserve_trace_spans_dropped_total{reason=\"export_failed\"} 100"),
            std::string::npos)
      << registry.render();
}

TEST(SpanExporter, ACollectorThatNeverAnswersOnlyFillsTheQueue) {
  std::promise<void> got_request;
  std::once_flag once;
  std::mutex held_mu;
  std::vector<http::Exchange> held;  // answered never; the server's stop() cuts them
  http::Route route{"POST", "/v1/traces", [&](http::Request, http::Exchange ex) {
                      {
                        std::lock_guard lock(held_mu);
                        held.push_back(ex);
                      }
                      std::call_once(once, [&] { got_request.set_value(); });
                    }};
  auto server = http::Server::start({}, {route});
  ASSERT_TRUE(server.ok());

  metrics::Registry registry;
  TraceConfig cfg;
  cfg.otlp_url = "http://127.0.0.1:" + std::to_string((*server)->port()) + "/v1/traces";
  cfg.queue_size = 16;
  cfg.batch_size = 1;
  cfg.export_timeout_ms = 600000;  // the collector hangs far longer than this test runs
  auto tracer = Tracer::create(cfg, "pdserve-test", &registry);
  ASSERT_TRUE(tracer.ok());
  (*tracer)->startSpan("first", std::nullopt).end();
  got_request.get_future().wait();  // the exporter thread is blocked in its POST
  int accepted = 0;
  for (int i = 0; i < 16 + 10; ++i) {
    (*tracer)->startSpan("request", std::nullopt).end();
    ++accepted;
  }
  EXPECT_EQ(accepted, 26);
  EXPECT_EQ((*tracer)->exporter()->droppedQueueFull(), 10u);
  (*server)->stop();  // cuts the hanging POST: the exporter thread moves on
  {
    std::lock_guard lock(held_mu);
    held.clear();
  }
  (*tracer)->exporter()->flush();
  EXPECT_EQ((*tracer)->exporter()->exportedSpans(), 0u);
}

TEST(SpanExporter, WritesJsonLinesToAFile) {
  test::TempDir dir;
  TraceConfig cfg;
  cfg.file = dir.path() / "spans.jsonl";
  {
    auto tracer = Tracer::create(cfg, "pdserve-test", nullptr);
    ASSERT_TRUE(tracer.ok());
    Span root = (*tracer)->startSpan("root", std::nullopt, SpanKind::Server);
    root.child("child").end();
    root.end();
    (*tracer)->exporter()->flush();
    (*tracer)->startSpan("late", std::nullopt).end();
  }  // the destructor exports "late"
  std::ifstream in(cfg.file);
  std::vector<std::string> names;
  for (std::string line; std::getline(in, line);) {
    const json::value doc = json::parse(line);
    for (const auto& s : doc.at("resourceSpans").at(0).at("scopeSpans").at(0).at("spans").as_array()) {
      names.emplace_back(s.at("name").as_string());
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"child", "root", "late"}));
}

TEST(OtlpUrl, BadUrlsAreConfigErrors) {
  for (const std::string url : {"https://collector:4318", "collector:4318", "http://", "http://h:0", "http://h:99999",
                                "http://h:12x", "http://[::1"}) {
    TraceConfig cfg;
    cfg.otlp_url = url;
    EXPECT_FALSE(Tracer::create(cfg, "x", nullptr).ok()) << url;
  }
}

}  // namespace
}  // namespace pd::trace
