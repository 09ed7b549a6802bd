#pragma once
/// Getting finished spans out of the process without ever slowing a request.
///
/// SpanExporter keeps a bounded queue. enqueue() — the only call on the request path — takes a
/// mutex for a push (never across I/O) and returns at once; when the queue is full the span is
/// dropped and counted. One background thread takes batches off the queue (when a batch is
/// full, or every `interval`) and hands them to each SpanSink; a sink that fails or is slow only
/// delays that thread, and what piles up meanwhile is dropped and counted, never waited for.
///
/// Metrics (when a registry is given):
///   pdserve_trace_spans_exported_total{sink}          spans a sink accepted
///   pdserve_trace_spans_dropped_total{reason}         queue_full | export_failed (per sink)
///   pdserve_trace_export_errors_total{sink}           failed export calls
///   pdserve_trace_queue_spans                         spans waiting now
///
/// Sinks: OTLP/HTTP JSON to a collector (POST .../v1/traces), and JSON lines in a file (one
/// ExportTraceServiceRequest per line and batch, the OpenTelemetry Collector's file format).
///
/// Thread rules: enqueue() and the counters are thread-safe; flush() and the destructor from a
/// thread that is not the exporter's own. Sinks run on the exporter thread only.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/metrics.h"
#include "pd/common/result.h"
#include "pd/trace/span_data.h"

namespace pd::trace {

/// Where batches go. A seam: tests fake a slow or failing collector with one.
class SpanSink {
 public:
  SpanSink() = default;
  SpanSink(const SpanSink&) = delete;
  SpanSink& operator=(const SpanSink&) = delete;
  SpanSink(SpanSink&&) = delete;
  SpanSink& operator=(SpanSink&&) = delete;
  virtual ~SpanSink() = default;

  /// A short name for metrics and logs ("otlp", "file").
  [[nodiscard]] virtual std::string_view name() const = 0;
  /// Exports one batch. Exporter thread only; may block, up to the sink's own timeout.
  [[nodiscard]] virtual Status exportBatch(std::span<const SpanData> spans) = 0;
};

/// POSTs each batch as OTLP JSON to `url` ("http://host:port/path"; an empty path or "/"
/// becomes "/v1/traces"), each call bounded by `timeout`. InvalidArgument for a URL it cannot
/// use (not http, no host, bad port). Nothing is connected until the first batch.
[[nodiscard]] Result<std::unique_ptr<SpanSink>> makeOtlpHttpSink(const std::string& url, Resource resource,
                                                                 std::chrono::milliseconds timeout);
/// Appends each batch as one line of OTLP JSON to `path` (created if missing). Io when the file
/// cannot be opened.
[[nodiscard]] Result<std::unique_ptr<SpanSink>> makeJsonLinesFileSink(const std::filesystem::path& path,
                                                                      Resource resource);

struct ExporterOptions {
  std::size_t queue_capacity = 4096;         ///< spans waiting; more are dropped
  std::size_t max_batch = 512;               ///< spans per export call
  std::chrono::milliseconds interval{1000};  ///< longest a span waits for a batch to fill
};

class SpanExporter {
 public:
  /// Starts the background thread. `registry` may be null (no metrics); it must outlive this.
  SpanExporter(std::vector<std::unique_ptr<SpanSink>> sinks, ExporterOptions options, metrics::Registry* registry);
  SpanExporter(const SpanExporter&) = delete;
  SpanExporter& operator=(const SpanExporter&) = delete;
  SpanExporter(SpanExporter&&) = delete;
  SpanExporter& operator=(SpanExporter&&) = delete;
  /// Exports what is queued (one last pass through the sinks, each bounded by its timeout) and
  /// joins the thread.
  ~SpanExporter();

  /// Never blocks on I/O. False when the span was dropped because the queue is full.
  bool enqueue(SpanData span);
  /// Blocks until every span enqueued before this call has been handed to the sinks (or
  /// dropped). For tests and orderly shutdown; not for the request path.
  void flush();

  [[nodiscard]] std::uint64_t droppedQueueFull() const { return dropped_queue_full_.load(); }
  [[nodiscard]] std::uint64_t exportedSpans() const { return exported_.load(); }
  [[nodiscard]] std::uint64_t failedExports() const { return failed_exports_.load(); }

 private:
  void run();
  void exportBatch(std::span<const SpanData> batch);

  std::vector<std::unique_ptr<SpanSink>> sinks_;
  ExporterOptions options_;
  std::atomic<std::uint64_t> dropped_queue_full_{0};
  std::atomic<std::uint64_t> exported_{0};
  std::atomic<std::uint64_t> failed_exports_{0};
  metrics::Counter* dropped_full_metric_ = nullptr;
  std::vector<metrics::Counter*> exported_metric_;        // per sink
  std::vector<metrics::Counter*> dropped_failed_metric_;  // per sink
  std::vector<metrics::Counter*> errors_metric_;          // per sink
  std::vector<bool> sink_failing_;                        // exporter thread only: for edge logging
  metrics::Gauge* queue_metric_ = nullptr;

  std::mutex mu_;
  std::condition_variable wake_;    // the exporter thread: a full batch, a flush, or stop
  std::condition_variable idle_;    // flush(): a pass finished
  std::vector<SpanData> queue_;     // guarded by mu_
  std::uint64_t accepted_seq_ = 0;  // guarded by mu_: spans queued so far
  std::uint64_t done_seq_ = 0;      // guarded by mu_: of those, handed to the sinks
  bool flush_requested_ = false;    // guarded by mu_
  bool stop_ = false;               // guarded by mu_
  std::thread thread_;              // last: started after everything above exists
};

}  // namespace pd::trace
