#include "pd/trace/exporter.h"

#include <algorithm>

#include "pd/common/check.h"
#include "pd/common/log.h"

namespace pd::trace {

SpanExporter::SpanExporter(std::vector<std::unique_ptr<SpanSink>> sinks, ExporterOptions options,
                           metrics::Registry* registry)
    : sinks_(std::move(sinks)), options_(options), sink_failing_(sinks_.size(), false) {
  PD_CHECK(options_.queue_capacity > 0 && options_.max_batch > 0);
  if (registry != nullptr) {
    auto& dropped = registry->counter("pdserve_trace_spans_dropped_total",
                                      "Finished spans not exported: queue_full (the exporter fell behind) or "
                                      "export_failed (a sink refused the batch)",
                                      {"reason"});
    dropped_full_metric_ = &dropped.labels({"queue_full"});
    auto& exported = registry->counter("pdserve_trace_spans_exported_total", "Spans a sink accepted", {"sink"});
    auto& errors = registry->counter("pdserve_trace_export_errors_total", "Failed span export calls", {"sink"});
    for (const auto& sink : sinks_) {
      const std::string name(sink->name());
      exported_metric_.push_back(&exported.labels({name}));
      errors_metric_.push_back(&errors.labels({name}));
      dropped_failed_metric_.push_back(&dropped.labels({"export_failed"}));
    }
    queue_metric_ = &registry->gauge("pdserve_trace_queue_spans", "Finished spans waiting for export").get();
  }
  thread_ = std::thread([this] { run(); });
}

SpanExporter::~SpanExporter() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

bool SpanExporter::enqueue(SpanData span) {
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    if (queue_.size() >= options_.queue_capacity) {
      dropped_queue_full_.fetch_add(1);
      if (dropped_full_metric_ != nullptr) dropped_full_metric_->inc();
      return false;
    }
    queue_.push_back(std::move(span));
    ++accepted_seq_;
    wake = queue_.size() == options_.max_batch;
    if (queue_metric_ != nullptr) queue_metric_->set(static_cast<double>(queue_.size()));
  }
  if (wake) wake_.notify_one();
  return true;
}

void SpanExporter::flush() {
  std::unique_lock lock(mu_);
  const std::uint64_t target = accepted_seq_;
  flush_requested_ = true;
  wake_.notify_one();
  idle_.wait(lock, [&] { return done_seq_ >= target; });
}

void SpanExporter::run() {
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait_for(lock, options_.interval,
                   [&] { return stop_ || flush_requested_ || queue_.size() >= options_.max_batch; });
    std::vector<SpanData> taken;
    taken.swap(queue_);
    const bool stopping = stop_;
    flush_requested_ = false;
    if (queue_metric_ != nullptr) queue_metric_->set(0);
    lock.unlock();
    for (std::size_t at = 0; at < taken.size(); at += options_.max_batch) {
      const std::size_t n = std::min(options_.max_batch, taken.size() - at);
      exportBatch(std::span<const SpanData>(taken).subspan(at, n));
      std::lock_guard done_lock(mu_);
      done_seq_ += n;
      idle_.notify_all();
    }
    lock.lock();
    idle_.notify_all();
    // After stop, one more pass picks up spans that arrived during the last export.
    if (stopping && queue_.empty()) return;
  }
}

void SpanExporter::exportBatch(std::span<const SpanData> batch) {
  for (std::size_t i = 0; i < sinks_.size(); ++i) {
    const Status s = sinks_[i]->exportBatch(batch);
    if (s.ok()) {
      exported_.fetch_add(batch.size());
      if (!exported_metric_.empty()) exported_metric_[i]->inc(static_cast<double>(batch.size()));
      if (sink_failing_[i]) log::info("trace", "span export to {} works again", sinks_[i]->name());
      sink_failing_[i] = false;
      continue;
    }
    failed_exports_.fetch_add(1);
    if (!errors_metric_.empty()) {
      errors_metric_[i]->inc();
      dropped_failed_metric_[i]->inc(static_cast<double>(batch.size()));
    }
    // One line when a sink starts failing, not one per batch.
    if (!sink_failing_[i]) {
      log::warn("trace",
                "span export to {} failed ({} spans dropped; further failures are counted in "
                "pdserve_trace_export_errors_total): {}",
                sinks_[i]->name(), batch.size(), s.error().toString());
    }
    sink_failing_[i] = true;
  }
}

}  // namespace pd::trace
