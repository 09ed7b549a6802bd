#pragma once
/// Spans and the tracer that starts them.
///
/// A Span is a move-only handle on one timed operation. A *recording* span (its trace is
/// sampled and tracing is on) collects a name, times, attributes and an error status, and is
/// handed to the exporter when it ends — explicitly with end(), or when the handle is destroyed.
/// A non-recording span of a sampled-out trace still has a context, so `traceparent` propagates
/// with the sampled flag off and the other processes skip the trace too. With tracing off a span
/// passes its caller's context through unchanged, or has none (the next process decides).
///
/// Typical use (a process's request handler):
///   Span span = tracer.startFromHeader("prefill", request.header(kTraceparentHeader), SpanKind::Server);
///   Span queue = span.child("prefill.queue");   ... queue.end();
///   tracer.record(span.context(), "prefill.chunk", start, end, {{"tokens", n}});  // timed elsewhere
///   client_headers.push_back({"traceparent", span.traceparent()});
///
/// Thread rules: Tracer is thread-safe and must outlive every span it started. A Span is used
/// by one thread at a time (it may move between threads).

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/metrics.h"
#include "pd/common/result.h"
#include "pd/trace/exporter.h"
#include "pd/trace/sampler.h"
#include "pd/trace/span_data.h"
#include "pd/trace/trace_config.h"

namespace pd::trace {

class Tracer;

class Span {
 public:
  /// An invalid, non-recording span (no trace): what a default-constructed member holds.
  Span() = default;
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  Span(Span&& other) noexcept;
  Span& operator=(Span&& other) noexcept;
  /// Ends the span if it was not ended.
  ~Span();

  [[nodiscard]] bool recording() const { return data_ != nullptr; }
  /// This span's context (invalid for a default-constructed span).
  [[nodiscard]] const SpanContext& context() const { return context_; }
  /// The `traceparent` value for calls made on this span's behalf; empty when invalid.
  [[nodiscard]] std::string traceparent() const;

  /// Starts a child span now (recording when this one is).
  [[nodiscard]] Span child(std::string name, SpanKind kind = SpanKind::Internal) const;

  void setAttribute(std::string key, AttributeValue value);
  /// Adds an OTLP link to `other` (ignored when `other` is invalid).
  void addLink(const SpanContext& other);
  /// Marks the span failed (OTLP status ERROR) with `message`.
  void setError(std::string message);
  /// Ends now; later calls do nothing.
  void end();
  /// Ends at `at` (for operations whose end was observed earlier).
  void end(TimePoint at);

 private:
  friend class Tracer;
  Span(const Tracer* tracer, SpanContext context, std::unique_ptr<SpanData> data)
      : tracer_(tracer), context_(context), data_(std::move(data)) {}

  const Tracer* tracer_ = nullptr;
  SpanContext context_;
  std::unique_ptr<SpanData> data_;  // null when not recording or already ended
};

class Tracer {
 public:
  /// Tracing off: nothing is recorded; a caller's context passes through, no trace is started.
  Tracer();
  /// Records sampled spans into `exporter` (null: nothing is recorded).
  Tracer(Sampler sampler, std::unique_ptr<SpanExporter> exporter);
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;
  Tracer(Tracer&&) = delete;
  Tracer& operator=(Tracer&&) = delete;
  /// Exports what is queued and stops the exporter thread.
  ~Tracer();

  /// The tracer `config` asks for: sinks for trace.otlp_url and trace.file (tracing is off when
  /// neither is set), trace.sample_ratio. `service_name` names the process in the traces
  /// (config.service_name overrides it). `registry` (may be null) gets the exporter's metrics
  /// and must outlive the tracer. Errors: InvalidArgument (bad URL), Io (file).
  [[nodiscard]] static Result<std::unique_ptr<Tracer>> create(const TraceConfig& config, std::string service_name,
                                                              metrics::Registry* registry);

  /// A tracer that is off (the default constructor's), for components given none; lives until exit.
  [[nodiscard]] static const Tracer& disabled();

  /// True when spans may be recorded (an exporter exists).
  [[nodiscard]] bool enabled() const { return exporter_ != nullptr; }

  /// Starts a span at `start` (default now): a child of `parent`, or the root of a new trace when
  /// `parent` is nullopt or invalid.
  [[nodiscard]] Span startSpan(std::string name, const std::optional<SpanContext>& parent,
                               SpanKind kind = SpanKind::Internal, TimePoint start = Clock::now()) const;
  /// Starts a span continuing a client's or caller's `traceparent` header value; a missing or
  /// malformed header starts a new trace.
  [[nodiscard]] Span startFromHeader(std::string name, std::string_view traceparent, SpanKind kind = SpanKind::Server,
                                     TimePoint start = Clock::now()) const;
  /// Records a finished child of `parent` with the given times (work timed elsewhere, such as
  /// on an engine thread). Nothing happens unless `parent` is valid and sampled and tracing is
  /// on. Returns the new span's context (for grandchildren), invalid when nothing was recorded.
  /// `id`: the new span's id when it was drawn beforehand (newSpanId()), for a span whose
  /// context must travel before it ends (the prefill worker's `prefill.completion`, named in the
  /// KV completion record); invalid (the default): a fresh one.
  SpanContext record(const SpanContext& parent, std::string name, TimePoint start, TimePoint end,
                     std::vector<Attribute> attributes = {}, SpanKind kind = SpanKind::Internal, SpanId id = {}) const;

  /// The exporter (null when tracing is off); for flush() in tests and shutdown.
  [[nodiscard]] SpanExporter* exporter() const { return exporter_.get(); }

 private:
  friend class Span;
  void finish(SpanData data) const;

  Sampler sampler_;
  std::unique_ptr<SpanExporter> exporter_;
};

}  // namespace pd::trace
