#include "pd/common/metrics.h"

#include <fmt/format.h>

#include <cmath>
#include <type_traits>
#include <utility>

#include "pd/common/check.h"

namespace pd::metrics {
namespace {

bool isValidMetricName(std::string_view name) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    const bool digit = c >= '0' && c <= '9';
    if (!alpha && !(digit && i > 0)) return false;
  }
  return true;
}

bool isValidLabelName(std::string_view name) {
  if (name.empty() || name.starts_with("__") || name == "le") return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!alpha && !(digit && i > 0)) return false;
  }
  return true;
}

std::string escapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

/// `{a="x",b="y"}` (or `{a="x",le="0.5"}` with an extra pair), empty when there are no labels.
void appendLabels(std::string& out, const std::vector<std::string>& names, const std::vector<std::string>& values,
                  std::string_view extra_name = {}, std::string_view extra_value = {}) {
  if (names.empty() && extra_name.empty()) return;
  out += '{';
  bool first = true;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!first) out += ',';
    first = false;
    out += names[i];
    out += "=\"";
    out += escapeLabelValue(values[i]);
    out += '"';
  }
  if (!extra_name.empty()) {
    if (!first) out += ',';
    out += extra_name;
    out += "=\"";
    out += extra_value;
    out += '"';
  }
  out += '}';
}

std::string_view typeName(MetricType type) {
  switch (type) {
    case MetricType::Counter:
      return "counter";
    case MetricType::Gauge:
      return "gauge";
    case MetricType::Histogram:
      return "histogram";
  }
  return "untyped";
}

template <class Metric>
constexpr MetricType typeOf();
template <>
constexpr MetricType typeOf<Counter>() {
  return MetricType::Counter;
}
template <>
constexpr MetricType typeOf<Gauge>() {
  return MetricType::Gauge;
}
template <>
constexpr MetricType typeOf<Histogram>() {
  return MetricType::Histogram;
}

}  // namespace

std::string formatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", value);
}

std::string escapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::vector<double> latencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0};
}

void Counter::inc(double amount) {
  PD_CHECK_MSG(amount >= 0.0, "a counter only goes up");
  value_.fetch_add(amount, std::memory_order_relaxed);
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<std::uint64_t>[bounds_.size() + 1]) {
  for (std::size_t i = 0; i < bounds_.size(); ++i) {
    PD_CHECK_MSG(std::isfinite(bounds_[i]), "histogram bounds must be finite (+Inf is implicit)");
    PD_CHECK_MSG(i == 0 || bounds_[i] > bounds_[i - 1], "histogram bounds must increase strictly");
  }
  for (std::size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::observe(double value) {
  std::size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;  // `le` is inclusive
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  s.cumulative.resize(bounds_.size() + 1);
  std::uint64_t running = 0;
  for (std::size_t i = 0; i <= bounds_.size(); ++i) {
    running += buckets_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = running;
  }
  // Count is the +Inf bucket so that the rendered series agree even while observations race.
  s.count = running;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

template <class Metric>
Family<Metric>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                       std::vector<double> bounds)
    : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)), bounds_(std::move(bounds)) {
  PD_CHECK_MSG(isValidMetricName(name_), "invalid metric name");
  for (const auto& label : label_names_) PD_CHECK_MSG(isValidLabelName(label), "invalid label name");
}

template <class Metric>
Metric& Family<Metric>::labels(const std::vector<std::string>& values) {
  PD_CHECK_MSG(values.size() == label_names_.size(), "label value count differs from the family's label names");
  std::lock_guard lock(mu_);
  auto it = children_.find(values);
  if (it == children_.end()) {
    std::unique_ptr<Metric> child;
    if constexpr (std::is_same_v<Metric, Histogram>) {
      child = std::make_unique<Histogram>(bounds_);
    } else {
      child = std::make_unique<Metric>();
    }
    it = children_.emplace(values, std::move(child)).first;
  }
  return *it->second;
}

template <class Metric>
void Family<Metric>::render(std::string& out) const {
  out += "# HELP ";
  out += name_;
  out += ' ';
  out += escapeHelp(help_);
  out += "\n# TYPE ";
  out += name_;
  out += ' ';
  out += typeName(typeOf<Metric>());
  out += '\n';
  std::lock_guard lock(mu_);
  for (const auto& [values, child] : children_) {
    if constexpr (std::is_same_v<Metric, Histogram>) {
      const Histogram::Snapshot s = child->snapshot();
      for (std::size_t i = 0; i <= s.bounds.size(); ++i) {
        out += name_;
        out += "_bucket";
        const std::string le = i < s.bounds.size() ? formatValue(s.bounds[i]) : "+Inf";
        appendLabels(out, label_names_, values, "le", le);
        out += ' ';
        out += std::to_string(s.cumulative[i]);
        out += '\n';
      }
      out += name_;
      out += "_sum";
      appendLabels(out, label_names_, values);
      out += ' ';
      out += formatValue(s.sum);
      out += '\n';
      out += name_;
      out += "_count";
      appendLabels(out, label_names_, values);
      out += ' ';
      out += std::to_string(s.count);
      out += '\n';
    } else {
      out += name_;
      appendLabels(out, label_names_, values);
      out += ' ';
      out += formatValue(child->value());
      out += '\n';
    }
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Registry::Entry& Registry::lookupOrAdd(const std::string& name, MetricType type,
                                       const std::vector<std::string>& label_names, const std::vector<double>& bounds,
                                       const std::string& help) {
  auto it = families_.find(name);
  if (it != families_.end()) {
    Entry& e = it->second;
    PD_CHECK_MSG(e.type == type, "metric re-registered with another type");
    bool same_labels = false;
    switch (type) {
      case MetricType::Counter:
        same_labels = e.counter->labelNames() == label_names;
        break;
      case MetricType::Gauge:
        same_labels = e.gauge->labelNames() == label_names;
        break;
      case MetricType::Histogram:
        same_labels = e.histogram->labelNames() == label_names;
        PD_CHECK_MSG(e.histogram->bounds() == bounds, "histogram re-registered with other buckets");
        break;
    }
    PD_CHECK_MSG(same_labels, "metric re-registered with other labels");
    return e;
  }
  Entry e{type, nullptr, nullptr, nullptr};
  switch (type) {
    case MetricType::Counter:
      e.counter = std::make_unique<Family<Counter>>(name, help, label_names, std::vector<double>{});
      break;
    case MetricType::Gauge:
      e.gauge = std::make_unique<Family<Gauge>>(name, help, label_names, std::vector<double>{});
      break;
    case MetricType::Histogram:
      e.histogram = std::make_unique<Family<Histogram>>(name, help, label_names, bounds);
      break;
  }
  return families_.emplace(name, std::move(e)).first->second;
}

Family<Counter>& Registry::counter(const std::string& name, const std::string& help,
                                   const std::vector<std::string>& label_names) {
  std::lock_guard lock(mu_);
  Family<Counter>& family = *lookupOrAdd(name, MetricType::Counter, label_names, {}, help).counter;
  if (family.labelNames().empty()) family.get();  // an unlabelled metric renders 0 from the start
  return family;
}

Family<Gauge>& Registry::gauge(const std::string& name, const std::string& help,
                               const std::vector<std::string>& label_names) {
  std::lock_guard lock(mu_);
  Family<Gauge>& family = *lookupOrAdd(name, MetricType::Gauge, label_names, {}, help).gauge;
  if (family.labelNames().empty()) family.get();
  return family;
}

Family<Histogram>& Registry::histogram(const std::string& name, const std::string& help,
                                       const std::vector<double>& bounds, const std::vector<std::string>& label_names) {
  std::lock_guard lock(mu_);
  Family<Histogram>& family = *lookupOrAdd(name, MetricType::Histogram, label_names, bounds, help).histogram;
  if (family.labelNames().empty()) family.get();
  return family;
}

std::string Registry::render() const {
  std::string out;
  std::lock_guard lock(mu_);
  for (const auto& [name, e] : families_) {
    switch (e.type) {
      case MetricType::Counter:
        e.counter->render(out);
        break;
      case MetricType::Gauge:
        e.gauge->render(out);
        break;
      case MetricType::Histogram:
        e.histogram->render(out);
        break;
    }
  }
  return out;
}

}  // namespace pd::metrics
