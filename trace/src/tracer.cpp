#include "pd/trace/tracer.h"

#include <unistd.h>

namespace pd::trace {

Span::Span(Span&& other) noexcept
    : tracer_(std::exchange(other.tracer_, nullptr)),
      context_(std::exchange(other.context_, SpanContext{})),
      data_(std::move(other.data_)) {}

Span& Span::operator=(Span&& other) noexcept {
  if (this != &other) {
    end();
    tracer_ = std::exchange(other.tracer_, nullptr);
    context_ = std::exchange(other.context_, SpanContext{});
    data_ = std::move(other.data_);
  }
  return *this;
}

Span::~Span() {
  end();
}

std::string Span::traceparent() const {
  return context_.valid() ? formatTraceparent(context_) : std::string();
}

Span Span::child(std::string name, SpanKind kind) const {
  if (tracer_ == nullptr) return {};
  return tracer_->startSpan(std::move(name), context_, kind);
}

void Span::setAttribute(std::string key, AttributeValue value) {
  if (data_) data_->attributes.push_back({std::move(key), std::move(value)});
}

void Span::addLink(const SpanContext& other) {
  if (data_ && other.valid()) data_->links.push_back(other);
}

void Span::setError(std::string message) {
  if (!data_) return;
  data_->error = true;
  data_->status_message = std::move(message);
}

void Span::end() {
  end(Clock::now());
}

void Span::end(TimePoint at) {
  if (!data_) return;
  data_->end = at;
  tracer_->finish(std::move(*data_));
  data_.reset();
}

Tracer::Tracer() : sampler_(0.0) {}

Tracer::Tracer(Sampler sampler, std::unique_ptr<SpanExporter> exporter)
    : sampler_(sampler), exporter_(std::move(exporter)) {}

Tracer::~Tracer() = default;

const Tracer& Tracer::disabled() {
  static const Tracer off;
  return off;
}

Result<std::unique_ptr<Tracer>> Tracer::create(const TraceConfig& config, std::string service_name,
                                               metrics::Registry* registry) {
  PD_TRY(validate(config));
  Resource resource;
  resource.service_name = config.service_name.empty() ? std::move(service_name) : std::string(config.service_name);
  resource.attributes.push_back({"process.pid", static_cast<std::int64_t>(::getpid())});
  std::vector<std::unique_ptr<SpanSink>> sinks;
  if (!config.otlp_url.empty()) {
    PD_ASSIGN_OR_RETURN(
        auto sink, makeOtlpHttpSink(config.otlp_url, resource, std::chrono::milliseconds{config.export_timeout_ms}));
    sinks.push_back(std::move(sink));
  }
  if (!config.file.empty()) {
    PD_ASSIGN_OR_RETURN(auto sink, makeJsonLinesFileSink(config.file, resource));
    sinks.push_back(std::move(sink));
  }
  if (sinks.empty()) return std::make_unique<Tracer>();
  ExporterOptions options;
  options.queue_capacity = static_cast<std::size_t>(config.queue_size);
  options.max_batch = static_cast<std::size_t>(config.batch_size);
  options.interval = std::chrono::milliseconds{config.export_interval_ms};
  return std::make_unique<Tracer>(Sampler(config.sample_ratio),
                                  std::make_unique<SpanExporter>(std::move(sinks), options, registry));
}

Span Tracer::startSpan(std::string name, const std::optional<SpanContext>& parent, SpanKind kind,
                       TimePoint start) const {
  const bool has_parent = parent && parent->valid();
  // Tracing off: a caller's context passes through unchanged (no span of ours to point at), and
  // no new trace is started, so the next process decides for itself (and nothing is spent here).
  if (!enabled()) return has_parent ? Span(this, *parent, nullptr) : Span();
  SpanContext ctx;
  ctx.trace_id = has_parent ? parent->trace_id : newTraceId();
  ctx.span_id = newSpanId();
  const bool sampled = sampler_.shouldSample(has_parent ? parent : std::nullopt, ctx.trace_id);
  ctx.flags = has_parent ? parent->flags : (sampled && enabled() ? kSampledFlag : 0);
  if (!sampled || !enabled()) return Span(this, ctx, nullptr);
  auto data = std::make_unique<SpanData>();
  data->context = ctx;
  if (has_parent) data->parent_span_id = parent->span_id;
  data->name = std::move(name);
  data->kind = kind;
  data->start = start;
  return Span(this, ctx, std::move(data));
}

Span Tracer::startFromHeader(std::string name, std::string_view traceparent, SpanKind kind, TimePoint start) const {
  return startSpan(std::move(name), parseTraceparent(traceparent), kind, start);
}

SpanContext Tracer::record(const SpanContext& parent, std::string name, TimePoint start, TimePoint end,
                           std::vector<Attribute> attributes, SpanKind kind, SpanId id) const {
  if (!enabled() || !parent.valid() || !parent.sampled()) return {};
  SpanData data;
  data.context = {parent.trace_id, id.valid() ? id : newSpanId(), parent.flags};
  data.parent_span_id = parent.span_id;
  data.name = std::move(name);
  data.kind = kind;
  data.start = start;
  data.end = end;
  data.attributes = std::move(attributes);
  const SpanContext ctx = data.context;
  finish(std::move(data));
  return ctx;
}

void Tracer::finish(SpanData data) const {
  if (exporter_) exporter_->enqueue(std::move(data));
}

}  // namespace pd::trace
