// Spans and the tracer: parent links, sampling decisions carried in the context, tracing off.
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "pd/trace/tracer.h"

namespace pd::trace {
namespace {

class CollectSink final : public SpanSink {
 public:
  explicit CollectSink(std::vector<SpanData>* out, std::mutex* mu) : out_(out), mu_(mu) {}
  [[nodiscard]] std::string_view name() const override { return "collect"; }
  Status exportBatch(std::span<const SpanData> spans) override {
    std::lock_guard lock(*mu_);
    out_->insert(out_->end(), spans.begin(), spans.end());
    return okStatus();
  }

 private:
  std::vector<SpanData>* out_;
  std::mutex* mu_;
};

struct Recorder {
  std::vector<SpanData> spans;
  std::mutex mu;
  std::unique_ptr<Tracer> tracer;

  explicit Recorder(double ratio) {
    std::vector<std::unique_ptr<SpanSink>> sinks;
    sinks.push_back(std::make_unique<CollectSink>(&spans, &mu));
    tracer = std::make_unique<Tracer>(Sampler(ratio),
                                      std::make_unique<SpanExporter>(std::move(sinks), ExporterOptions{}, nullptr));
  }
  std::vector<SpanData> collected() {
    tracer->exporter()->flush();
    std::lock_guard lock(mu);
    return spans;
  }
};

TEST(Tracer, ChildrenAndRecordedSpansLinkToTheirParents) {
  Recorder r(1.0);
  Span root = r.tracer->startFromHeader("router.request", "", SpanKind::Server);
  ASSERT_TRUE(root.recording());
  ASSERT_TRUE(root.context().sampled());
  Span leg = root.child("router.prefill_leg", SpanKind::Client);
  leg.setAttribute("pd.worker", std::string("p0"));
  // The callee continues the caller's context from the header.
  Span remote = r.tracer->startFromHeader("prefill.request", leg.traceparent());
  const auto t0 = Clock::now();
  const SpanContext chunk = r.tracer->record(remote.context(), "prefill.chunk", t0, t0 + std::chrono::milliseconds{3},
                                             {{"pd.tokens", std::int64_t{16}}});
  EXPECT_TRUE(chunk.valid());
  remote.setError("Timeout: x");
  remote.end();
  leg.end();
  root.end();
  root.end();  // idempotent

  const auto spans = r.collected();
  ASSERT_EQ(spans.size(), 4u);
  std::map<std::string, SpanData> by_name;
  for (const auto& s : spans) by_name[s.name] = s;
  const auto& req = by_name["router.request"];
  EXPECT_FALSE(req.parent_span_id.valid());
  for (const auto& s : spans) EXPECT_EQ(s.context.trace_id, req.context.trace_id) << s.name;
  EXPECT_EQ(by_name["router.prefill_leg"].parent_span_id, req.context.span_id);
  EXPECT_EQ(by_name["prefill.request"].parent_span_id, by_name["router.prefill_leg"].context.span_id);
  EXPECT_EQ(by_name["prefill.chunk"].parent_span_id, by_name["prefill.request"].context.span_id);
  EXPECT_EQ(by_name["prefill.chunk"].end - by_name["prefill.chunk"].start, std::chrono::milliseconds{3});
  EXPECT_TRUE(by_name["prefill.request"].error);
  EXPECT_LE(req.start, req.end);
}

// A span whose context travels before it ends (the prefill worker's completion span, named in
// the KV completion record) is recorded later under the id drawn for it.
TEST(Tracer, ARecordedSpanKeepsAnIdDrawnBeforehand) {
  Recorder r(1.0);
  Span parent = r.tracer->startFromHeader("prefill.request", "", SpanKind::Server);
  const SpanId drawn = newSpanId();
  const auto t0 = Clock::now();
  const SpanContext done =
      r.tracer->record(parent.context(), "prefill.completion", t0, t0, {}, SpanKind::Internal, drawn);
  EXPECT_EQ(done.span_id, drawn);
  EXPECT_EQ(done.trace_id, parent.context().trace_id);
  const SpanContext fresh = r.tracer->record(parent.context(), "prefill.queue", t0, t0);
  EXPECT_TRUE(fresh.span_id.valid());
  EXPECT_NE(fresh.span_id, drawn);
  parent.end();
  std::map<std::string, SpanData> by_name;
  for (const auto& s : r.collected()) by_name[s.name] = s;
  EXPECT_EQ(by_name["prefill.completion"].context.span_id, drawn);
  EXPECT_EQ(by_name["prefill.completion"].parent_span_id, parent.context().span_id);
}

TEST(Tracer, ASpanCarriesItsValidLinks) {
  Recorder r(1.0);
  const SpanContext remote{newTraceId(), newSpanId(), kSampledFlag};
  const SpanContext other{newTraceId(), newSpanId(), kSampledFlag};
  Span s = r.tracer->startSpan("decode.kv_record", remote);
  s.addLink(other);
  s.addLink(SpanContext{});  // invalid: ignored
  s.end();
  const auto spans = r.collected();
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].parent_span_id, remote.span_id);
  EXPECT_EQ(spans[0].context.trace_id, remote.trace_id);
  ASSERT_EQ(spans[0].links.size(), 1u);
  EXPECT_EQ(spans[0].links[0], other);
}

TEST(Tracer, AnUnsampledCallerIsNotRecordedButPropagates) {
  Recorder r(1.0);
  const std::string caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
  Span s = r.tracer->startFromHeader("prefill.request", caller);
  EXPECT_FALSE(s.recording());
  EXPECT_EQ(s.context().trace_id.hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_FALSE(s.context().sampled());
  EXPECT_FALSE(r.tracer->record(s.context(), "x", Clock::now(), Clock::now()).valid());
  s.end();
  EXPECT_TRUE(r.collected().empty());
}

TEST(Tracer, RatioZeroStartsUnsampledTraces) {
  Recorder r(0.0);
  Span s = r.tracer->startSpan("router.request", std::nullopt);
  EXPECT_FALSE(s.recording());
  EXPECT_TRUE(s.context().valid());
  EXPECT_NE(s.traceparent().find("-00"), std::string::npos);
  s.end();
  EXPECT_TRUE(r.collected().empty());
}

TEST(Tracer, OffPassesTheCallersContextThrough) {
  Tracer off;
  EXPECT_FALSE(off.enabled());
  const std::string caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  Span s = off.startFromHeader("prefill.request", caller);
  EXPECT_FALSE(s.recording());
  EXPECT_EQ(s.traceparent(), caller);
  // No trace of its own: the next process (which may trace) starts one.
  Span fresh = off.startFromHeader("router.request", "garbage");
  EXPECT_FALSE(fresh.context().valid());
  EXPECT_TRUE(fresh.traceparent().empty());
  EXPECT_TRUE(fresh.child("x").traceparent().empty());
  EXPECT_TRUE(Span().traceparent().empty());
}

TEST(Tracer, NoSinksConfiguredMeansOff) {
  auto t = Tracer::create(TraceConfig{}, "pdserve-router", nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE((*t)->enabled());
}

}  // namespace
}  // namespace pd::trace
