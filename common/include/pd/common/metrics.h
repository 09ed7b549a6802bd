#pragma once
/// A small Prometheus metrics registry: counters, gauges and fixed-bucket histograms, each a
/// family of children keyed by label values, rendered in the text exposition format 0.0.4
/// (https://prometheus.io/docs/instrumenting/exposition_formats/).
///
/// Thread rules: everything here is thread-safe. Registering a family and looking up a child take
/// a mutex; updating a child (inc/set/observe) is lock-free. References returned by the registry
/// and by families stay valid for the registry's lifetime, so hot paths look a child up once and
/// keep the reference.
///
/// Errors: metric and label names are chosen by code, not by users, so an invalid name, a label
/// count mismatch or re-registering a name with another type are bugs (PD_CHECK). Label *values*
/// may be anything; they are escaped on output.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace pd::metrics {

/// A monotonically increasing value (Prometheus `counter`).
class Counter {
 public:
  /// Adds `amount`, which must be >= 0.
  void inc(double amount = 1.0);
  [[nodiscard]] double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// A value that goes up and down (Prometheus `gauge`).
class Gauge {
 public:
  void set(double value) { value_.store(value, std::memory_order_relaxed); }
  void inc(double amount = 1.0) { value_.fetch_add(amount, std::memory_order_relaxed); }
  void dec(double amount = 1.0) { value_.fetch_sub(amount, std::memory_order_relaxed); }
  [[nodiscard]] double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// Observations counted into fixed buckets (Prometheus `histogram`). Bucket upper bounds are set
/// at registration; +Inf is implicit.
class Histogram {
 public:
  /// `bounds` strictly increasing and finite (checked).
  explicit Histogram(std::vector<double> bounds);

  void observe(double value);

  /// A consistent-enough snapshot for rendering and tests (cumulative counts, +Inf last).
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<std::uint64_t> cumulative;  ///< bounds.size() + 1 entries; the last is +Inf
    double sum = 0.0;
    std::uint64_t count = 0;
  };
  [[nodiscard]] Snapshot snapshot() const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> buckets_;  ///< per bucket (not cumulative), +Inf last
  std::atomic<double> sum_{0.0};
  std::atomic<std::uint64_t> count_{0};
};

enum class MetricType { Counter, Gauge, Histogram };

/// All children of one metric name. `labels({...})` returns the child for those label values,
/// creating it on first use; the number of values must equal the family's label names.
template <class Metric>
class Family {
 public:
  Family(std::string name, std::string help, std::vector<std::string> label_names, std::vector<double> bounds);

  Metric& labels(const std::vector<std::string>& values);
  /// The child of a family without labels.
  Metric& get() { return labels({}); }

  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] const std::string& help() const { return help_; }
  [[nodiscard]] const std::vector<std::string>& labelNames() const { return label_names_; }
  [[nodiscard]] const std::vector<double>& bounds() const { return bounds_; }
  /// Appends this family's exposition text to `out`.
  void render(std::string& out) const;

 private:
  std::string name_;
  std::string help_;
  std::vector<std::string> label_names_;
  std::vector<double> bounds_;  ///< histograms only
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<Metric>> children_;
};

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

/// Default latency buckets in seconds (1 ms .. 60 s), suited to TTFT and end-to-end latency.
std::vector<double> latencyBuckets();

/// The registry: owns every family. Registering the same name again with the same type and
/// labels returns the existing family, so independent components may share one metric.
class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;
  Registry(Registry&&) = delete;
  Registry& operator=(Registry&&) = delete;
  ~Registry() = default;

  Family<Counter>& counter(const std::string& name, const std::string& help,
                           const std::vector<std::string>& label_names = {});
  Family<Gauge>& gauge(const std::string& name, const std::string& help,
                       const std::vector<std::string>& label_names = {});
  Family<Histogram>& histogram(const std::string& name, const std::string& help, const std::vector<double>& bounds,
                               const std::vector<std::string>& label_names = {});

  /// The whole registry in the text exposition format, families sorted by name, children by
  /// label values. Serve it as `text/plain; version=0.0.4; charset=utf-8`.
  [[nodiscard]] std::string render() const;

 private:
  struct Entry {
    MetricType type;
    std::unique_ptr<Family<Counter>> counter;
    std::unique_ptr<Family<Gauge>> gauge;
    std::unique_ptr<Family<Histogram>> histogram;
  };
  Entry& lookupOrAdd(const std::string& name, MetricType type, const std::vector<std::string>& label_names,
                     const std::vector<double>& bounds, const std::string& help);

  mutable std::mutex mu_;
  std::map<std::string, Entry> families_;
};

/// The content type of `Registry::render()`.
inline constexpr std::string_view kExpositionContentType = "text/plain; version=0.0.4; charset=utf-8";

/// Formats a sample value as Prometheus expects: shortest round-trip decimal, `+Inf`, `-Inf`, `NaN`.
std::string formatValue(double value);
/// Escapes a label value: backslash, double quote and newline.
std::string escapeLabelValue(std::string_view value);

}  // namespace pd::metrics
