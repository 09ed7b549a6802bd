// JSON, markdown, SVG and progress text of `pdserve bench serve` (report.h).
#include "bench/serve/report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cmath>

namespace pd::bench {
namespace {

double finite(double v) {
  return std::isfinite(v) ? v : 0.0;
}

void putDistribution(boost::json::object& o, std::string_view metric, const Distribution& d) {
  o[fmt::format("mean_{}_ms", metric)] = finite(d.mean);
  o[fmt::format("median_{}_ms", metric)] = finite(d.p50);
  o[fmt::format("p90_{}_ms", metric)] = finite(d.p90);
  o[fmt::format("p99_{}_ms", metric)] = finite(d.p99);
  o[fmt::format("max_{}_ms", metric)] = finite(d.max);
}

std::optional<double> perUserTokensPerS(const LevelStats& l) {
  if (l.tpot_ms.count == 0 || !(l.tpot_ms.mean > 0)) return std::nullopt;
  return 1000.0 / l.tpot_ms.mean;
}

boost::json::object levelJson(const LevelStats& l) {
  boost::json::object o;
  if (l.concurrency > 0) o["concurrency"] = l.concurrency;
  if (l.request_rate > 0) o["request_rate"] = l.request_rate;
  o["completed"] = l.completed;
  o["failed"] = l.failed;
  boost::json::array errors;
  for (const auto& e : l.errors) errors.push_back(boost::json::object{{"message", e.message}, {"count", e.count}});
  o["errors"] = std::move(errors);
  o["duration_s"] = finite(l.duration_s);
  o["total_input_tokens"] = l.total_input_tokens;
  o["total_output_tokens"] = l.total_output_tokens;
  o["request_throughput"] = finite(l.request_throughput);
  o["output_throughput"] = finite(l.output_throughput);
  o["output_tokens_per_s"] = finite(l.output_throughput);
  o["total_token_throughput"] = finite(l.total_token_throughput);
  if (auto u = perUserTokensPerS(l)) o["output_tokens_per_s_per_user"] = *u;
  o["mean_concurrency"] = finite(l.mean_concurrency);
  if (l.request_goodput) o["request_goodput"] = finite(*l.request_goodput);
  putDistribution(o, "ttft", l.ttft_ms);
  putDistribution(o, "tpot", l.tpot_ms);
  putDistribution(o, "itl", l.itl_ms);
  putDistribution(o, "e2el", l.e2e_ms);
  if (l.mtp) {
    boost::json::object m{{"drafts_proposed", l.mtp->drafts_proposed},
                          {"drafts_accepted", l.mtp->drafts_accepted},
                          {"decode_generated_tokens", l.mtp->generated_tokens},
                          {"decode_steps", l.mtp->steps}};
    if (l.mtp->acceptance_rate) m["acceptance_rate"] = *l.mtp->acceptance_rate;
    if (l.mtp->accepted_tokens_per_step) m["accepted_tokens_per_step"] = *l.mtp->accepted_tokens_per_step;
    o["mtp"] = std::move(m);
  }
  if (l.prefill) {
    const PrefillServerStats& p = *l.prefill;
    boost::json::object m{{"prompts", p.prompts}};
    const auto put = [&m](const char* key, const std::optional<double>& v) {
      m[key] = v ? boost::json::value(finite(*v)) : boost::json::value(nullptr);
    };
    put("queue_ms_mean", p.queue_ms);
    put("compute_ms_mean", p.compute_ms);
    put("kv_tail_ms_mean", p.kv_tail_ms);
    put("kv_transfer_ms_mean", p.kv_transfer_ms);
    put("kv_bytes_per_prompt", p.kv_bytes);
    o["prefill"] = std::move(m);
  }
  return o;
}

std::string fmtMs(const Distribution& d) {
  if (d.count == 0) return "–";
  return fmt::format("{:.1f} / {:.1f} / {:.1f} / {:.1f}", d.mean, d.p50, d.p90, d.p99);
}

std::string describeRun(const RunInfo& i) {
  std::string prompts =
      i.prompts == "random"
          ? fmt::format("random prompts of {} {}, {} output tokens", i.input_tokens,
                        i.endpoint == "chat" ? "words" : "token ids", i.output_tokens)
          : fmt::format("prompts from {}, max_tokens {} unless set per line", i.prompts, i.output_tokens);
  std::string text = fmt::format("`{}` at {}, /v1/{}, {}{}, seed {}", i.model, i.url,
                                 i.endpoint == "chat" ? "chat/completions" : "completions", prompts,
                                 i.ignore_eos ? ", ignore_eos" : "", i.seed);
  if (i.net_latency_ms) text += fmt::format(", network latency {} ms", *i.net_latency_ms);
  if (!i.started_at.empty()) text += ", started " + i.started_at;
  return text;
}

// --- SVG -------------------------------------------------------------------------------------

struct Point {
  double x;
  double y;
  std::string label;
};
struct Series {
  std::string name;
  std::string color;
  std::vector<Point> points;
};

// Round tick steps: 1, 2 or 5 times a power of ten, about `target` ticks over [lo, hi].
std::vector<double> niceTicks(double lo, double hi, int target) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / std::max(target, 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (const double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * magnitude;
    if (step >= raw) break;
  }
  std::vector<double> ticks;
  for (auto k = static_cast<std::int64_t>(std::ceil(lo / step)); static_cast<double>(k) * step <= hi + step * 1e-9;
       ++k) {
    ticks.push_back(static_cast<double>(k) * step);
  }
  return ticks;
}

std::string tickText(double v) {
  if (v != 0 && (std::fabs(v) >= 1e5 || std::fabs(v) < 1e-2)) return fmt::format("{:.0e}", v);
  if (std::fabs(v - std::round(v)) < 1e-9) return fmt::format("{:.0f}", v);
  return fmt::format("{:g}", v);
}

// One chart in the box (x0, y0, w, h). With log2_x the x axis is log2 and ticked at the data.
std::string panel(double x0, double y0, double w, double h, const std::string& title, const std::string& x_label,
                  const std::string& y_label, const std::vector<Series>& series, bool log2_x) {
  constexpr double kLeft = 70;
  constexpr double kRight = 20;
  constexpr double kTop = 36;
  constexpr double kBottom = 50;
  const double px = x0 + kLeft;
  const double py = y0 + kTop;
  const double pw = w - kLeft - kRight;
  const double ph = h - kTop - kBottom;
  std::string s;
  s += fmt::format(
      R"svg(<g class="panel"><text x="{:.1f}" y="{:.1f}" text-anchor="middle" font-size="15" font-weight="bold">{}</text>)svg",
      x0 + w / 2, y0 + 20, xmlEscape(title));
  s += '\n';
  const auto tx = [&](double v) { return log2_x ? std::log2(std::max(v, 1e-12)) : v; };
  std::vector<double> xs;
  std::vector<double> ys;
  for (const auto& se : series) {
    for (const auto& p : se.points) {
      if (!std::isfinite(p.x) || !std::isfinite(p.y)) continue;
      if (log2_x && !(p.x > 0)) continue;
      xs.push_back(p.x);
      ys.push_back(p.y);
    }
  }
  s += fmt::format(R"svg(<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="none" stroke="#444"/>)svg",
                   px, py, pw, ph);
  s += '\n';
  s += fmt::format(R"svg(<text x="{:.1f}" y="{:.1f}" text-anchor="middle" font-size="12">{}</text>)svg", px + pw / 2,
                   y0 + h - 10, xmlEscape(x_label));
  s += '\n';
  s += fmt::format(
      R"svg(<text x="{:.1f}" y="{:.1f}" text-anchor="middle" font-size="12" transform="rotate(-90 {:.1f} {:.1f})">{}</text>)svg",
      x0 + 16, py + ph / 2, x0 + 16, py + ph / 2, xmlEscape(y_label));
  s += '\n';
  if (xs.empty()) {
    s += fmt::format(
        R"svg(<text x="{:.1f}" y="{:.1f}" text-anchor="middle" font-size="13" fill="#888">no data</text>)svg",
        px + pw / 2, py + ph / 2);
    return s + "</g>\n";
  }
  double xlo = tx(*std::min_element(xs.begin(), xs.end()));
  double xhi = tx(*std::max_element(xs.begin(), xs.end()));
  if (!log2_x) xlo = std::min(xlo, 0.0);
  if (xhi - xlo < 1e-9) {
    xlo -= 1;
    xhi += 1;
  }
  const double xpad = (xhi - xlo) * 0.05;
  xlo -= log2_x ? xpad : 0;
  xhi += xpad;
  const double ylo = 0;
  double yhi = *std::max_element(ys.begin(), ys.end());
  if (!(yhi > 0)) yhi = 1;
  yhi *= 1.1;
  const auto mx = [&](double v) { return px + (tx(v) - xlo) / (xhi - xlo) * pw; };
  const auto my = [&](double v) { return py + ph - (v - ylo) / (yhi - ylo) * ph; };

  std::vector<double> xticks;
  if (log2_x) {
    xticks = xs;
    std::sort(xticks.begin(), xticks.end());
    xticks.erase(std::unique(xticks.begin(), xticks.end()), xticks.end());
  } else {
    xticks = niceTicks(xlo, xhi, 6);
  }
  for (const double t : xticks) {
    const double x = mx(t);
    if (x < px - 0.5 || x > px + pw + 0.5) continue;
    s += fmt::format(R"svg(<line x1="{0:.1f}" y1="{1:.1f}" x2="{0:.1f}" y2="{2:.1f}" stroke="#ddd"/>)svg", x, py,
                     py + ph);
    s += fmt::format(R"svg(<text x="{:.1f}" y="{:.1f}" text-anchor="middle" font-size="11">{}</text>)svg", x,
                     py + ph + 16, tickText(t));
    s += '\n';
  }
  for (const double t : niceTicks(ylo, yhi, 5)) {
    const double y = my(t);
    if (y < py - 0.5 || y > py + ph + 0.5) continue;
    s += fmt::format(R"svg(<line x1="{0:.1f}" y1="{1:.1f}" x2="{2:.1f}" y2="{1:.1f}" stroke="#ddd"/>)svg", px, y,
                     px + pw);
    s += fmt::format(R"svg(<text x="{:.1f}" y="{:.1f}" text-anchor="end" font-size="11">{}</text>)svg", px - 6, y + 4,
                     tickText(t));
    s += '\n';
  }
  for (const auto& se : series) {
    std::string path;
    for (const auto& p : se.points) {
      if (!std::isfinite(p.x) || !std::isfinite(p.y) || (log2_x && !(p.x > 0))) continue;
      path += fmt::format("{}{:.1f},{:.1f}", path.empty() ? "" : " ", mx(p.x), my(p.y));
    }
    if (!path.empty()) {
      s += fmt::format(R"svg(<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>)svg", path, se.color);
      s += '\n';
    }
    for (const auto& p : se.points) {
      if (!std::isfinite(p.x) || !std::isfinite(p.y) || (log2_x && !(p.x > 0))) continue;
      s +=
          fmt::format(R"svg(<circle cx="{:.1f}" cy="{:.1f}" r="3.5" fill="{}"><title>{}</title></circle>)svg", mx(p.x),
                      my(p.y), se.color, xmlEscape(fmt::format("{}: {} ({:.1f}, {:.1f})", se.name, p.label, p.x, p.y)));
      if (!p.label.empty()) {
        s += fmt::format(R"svg(<text x="{:.1f}" y="{:.1f}" font-size="10" fill="#555">{}</text>)svg", mx(p.x) + 5,
                         my(p.y) - 5, xmlEscape(p.label));
      }
      s += '\n';
    }
  }
  // Legend, top left inside the plot.
  double ly = py + 14;
  for (const auto& se : series) {
    s += fmt::format(R"svg(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" stroke="{}" stroke-width="2"/>)svg",
                     px + 10, ly - 4, px + 30, ly - 4, se.color);
    s += fmt::format(R"svg(<text x="{:.1f}" y="{:.1f}" font-size="11">{}</text>)svg", px + 36, ly, xmlEscape(se.name));
    s += '\n';
    ly += 16;
  }
  return s + "</g>\n";
}

}  // namespace

std::string xmlEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // XML 1.0 allows no control characters other than tab, newline and carriage return.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') {
          out += ' ';
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string levelLabel(const LevelStats& level) {
  if (level.request_rate > 0) return fmt::format("rate {:g}/s", level.request_rate);
  return fmt::format("concurrency {}", level.concurrency);
}

std::string toJson(const BenchReport& report) {
  const auto& i = report.info;
  boost::json::object o;
  o["tool"] = "pdserve bench serve";
  o["url"] = i.url;
  // vLLM's key; "model" would be read by `pdserve plan --calibrate` as a preset or checkpoint.
  o["model_id"] = i.model;
  o["endpoint"] = i.endpoint;
  o["prompts"] = i.prompts;
  if (i.prompts == "random") o["input_tokens"] = i.input_tokens;
  o["output_tokens"] = i.output_tokens;
  o["ignore_eos"] = i.ignore_eos;
  o["seed"] = i.seed;
  o["mode"] = i.mode;
  if (!i.started_at.empty()) o["started_at"] = i.started_at;
  boost::json::object slo;
  if (i.slo.ttft_ms) slo["ttft_ms"] = *i.slo.ttft_ms;
  if (i.slo.tpot_ms) slo["tpot_ms"] = *i.slo.tpot_ms;
  if (i.slo.e2e_ms) slo["e2el_ms"] = *i.slo.e2e_ms;
  o["slo"] = std::move(slo);
  if (i.net_latency_ms) o["net_latency_ms"] = *i.net_latency_ms;
  boost::json::array levels;
  for (const auto& l : report.levels) levels.push_back(levelJson(l));
  o["levels"] = std::move(levels);
  return boost::json::serialize(o);
}

std::string toMarkdown(const BenchReport& report) {
  std::string md = "### pdserve bench serve\n\n" + describeRun(report.info) + ".\n\n";
  const bool rate = report.info.mode == "request_rate";
  const bool goodput = report.info.slo.any();
  bool mtp = false;
  bool prefill = false;
  for (const auto& l : report.levels) {
    mtp = mtp || (l.mtp && l.mtp->accepted_tokens_per_step);
    prefill = prefill || l.prefill.has_value();
  }
  md += fmt::format(
      "| {} | ok | failed | req/s | output tok/s | total tok/s | tok/s per user | TTFT ms mean / p50 / p90 / p99 "
      "| TPOT ms | ITL ms | E2E ms |{}{}{}\n",
      rate ? "rate (req/s)" : "concurrency", goodput ? " goodput (req/s) |" : "", mtp ? " MTP accepted / step |" : "",
      prefill ? " prefill ms / prompt | KV tail ms / prompt | KV transfer ms / prompt |" : "");
  md += fmt::format("|---|---|---|---|---|---|---|---|---|---|---|{}{}{}\n", goodput ? "---|" : "", mtp ? "---|" : "",
                    prefill ? "---|---|---|" : "");
  for (const auto& l : report.levels) {
    const auto user = perUserTokensPerS(l);
    md += fmt::format("| {} | {} | {} | {:.2f} | {:.1f} | {:.1f} | {} | {} | {} | {} | {} |",
                      rate ? fmt::format("{:g}", l.request_rate) : std::to_string(l.concurrency), l.completed, l.failed,
                      l.request_throughput, l.output_throughput, l.total_token_throughput,
                      user ? fmt::format("{:.1f}", *user) : "–", fmtMs(l.ttft_ms), fmtMs(l.tpot_ms), fmtMs(l.itl_ms),
                      fmtMs(l.e2e_ms));
    if (goodput) md += fmt::format(" {:.2f} |", l.request_goodput.value_or(0));
    if (mtp) {
      md += (l.mtp && l.mtp->accepted_tokens_per_step) ? fmt::format(" {:.2f} |", *l.mtp->accepted_tokens_per_step)
                                                       : std::string(" – |");
    }
    if (prefill) {
      const auto cell = [](const std::optional<double>& v) {
        return v ? fmt::format(" {:.2f} |", *v) : std::string(" – |");
      };
      const PrefillServerStats none;
      const PrefillServerStats& p = l.prefill ? *l.prefill : none;
      md += cell(p.compute_ms) + cell(p.kv_tail_ms) + cell(p.kv_transfer_ms);
    }
    md += '\n';
  }
  md += "\nTPOT, ITL and E2E columns are mean / p50 / p90 / p99 like TTFT. Tok/s per user = 1000 / mean TPOT.\n";
  if (prefill) {
    md +=
        "Prefill and KV columns are the prefill workers' own means per prompt (their /metrics): prefill = first "
        "forward to last layer computed, KV tail = last layer to completion record delivered (what the transfer "
        "adds to TTFT), KV transfer = the whole send, overlapping the prefill.\n";
  }
  if (goodput) {
    std::vector<std::string> slos;
    if (report.info.slo.ttft_ms) slos.push_back(fmt::format("TTFT ≤ {:g} ms", *report.info.slo.ttft_ms));
    if (report.info.slo.tpot_ms) slos.push_back(fmt::format("TPOT ≤ {:g} ms", *report.info.slo.tpot_ms));
    if (report.info.slo.e2e_ms) slos.push_back(fmt::format("E2E ≤ {:g} ms", *report.info.slo.e2e_ms));
    md += fmt::format("Goodput counts requests meeting {}.\n", fmt::join(slos, ", "));
  }
  for (const auto& l : report.levels) {
    for (const auto& e : l.errors) {
      md += fmt::format("\n- {}: {} × {}", levelLabel(l), e.count, e.message);
    }
  }
  if (md.back() != '\n') md += '\n';
  return md;
}

std::string toSvg(const BenchReport& report) {
  constexpr double kWidth = 960;
  constexpr double kHeight = 420;
  const bool rate = report.info.mode == "request_rate";
  Series p50{"median TTFT", "#1f77b4", {}};
  Series p99{"p99 TTFT", "#d62728", {}};
  Series out{"output tok/s", "#2ca02c", {}};
  Series total{"total tok/s (input + output)", "#9467bd", {}};
  for (const auto& l : report.levels) {
    if (l.completed == 0) continue;
    const std::string label = rate ? fmt::format("{:g}/s", l.request_rate) : fmt::format("c={}", l.concurrency);
    p50.points.push_back({l.output_throughput, l.ttft_ms.p50, label});
    p99.points.push_back({l.output_throughput, l.ttft_ms.p99, label});
    const double x = rate ? l.request_rate : static_cast<double>(l.concurrency);
    out.points.push_back({x, l.output_throughput, ""});
    total.points.push_back({x, l.total_token_throughput, ""});
  }
  std::string s = fmt::format(
      R"svg(<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{0:.0f}" height="{1:.0f}" viewBox="0 0 {0:.0f} {1:.0f}" font-family="sans-serif">
<title>{2}</title>
<rect width="100%" height="100%" fill="white"/>
)svg",
      kWidth, kHeight, xmlEscape("pdserve bench serve: " + describeRun(report.info)));
  s += fmt::format(R"svg(<text x="{:.1f}" y="18" text-anchor="middle" font-size="12" fill="#333">{}</text>)svg",
                   kWidth / 2, xmlEscape(report.info.model + " at " + report.info.url));
  s += '\n';
  s += panel(0, 20, kWidth / 2, kHeight - 20, "TTFT vs output throughput", "output tokens/s (all requests)",
             "time to first token (ms)", {p50, p99}, false);
  s +=
      panel(kWidth / 2, 20, kWidth / 2, kHeight - 20, rate ? "Throughput vs request rate" : "Throughput vs concurrency",
            rate ? "request rate (req/s)" : "concurrent requests (log scale)", "tokens/s", {out, total}, !rate);
  s += "</svg>\n";
  return s;
}

std::string progressLine(const std::string& label, std::int64_t done, std::int64_t total, std::int64_t failed,
                         double output_tokens_per_s, bool warming_up, int width) {
  if (warming_up) return fmt::format("{:<16} warming up", label);
  const double frac = total > 0 ? std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0) : 0.0;
  const int filled = static_cast<int>(std::lround(frac * width));
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.append(static_cast<std::size_t>(width - filled), '.');
  std::string line = fmt::format("{:<16} [{}] {}/{} req", label, bar, done, total);
  if (failed > 0) line += fmt::format("  {} failed", failed);
  line += fmt::format("  {:.0f} tok/s", output_tokens_per_s);
  return line;
}

std::string levelSummaryLine(const LevelStats& l) {
  std::string line = fmt::format(
      "{}: {} ok, {} failed, {:.2f} req/s, {:.1f} output tok/s, TTFT p50 {:.1f} ms p99 {:.1f} ms, TPOT p50 {:.2f} ms, "
      "ITL p50 {:.2f} ms",
      levelLabel(l), l.completed, l.failed, l.request_throughput, l.output_throughput, l.ttft_ms.p50, l.ttft_ms.p99,
      l.tpot_ms.p50, l.itl_ms.p50);
  if (l.request_goodput) line += fmt::format(", goodput {:.2f} req/s", *l.request_goodput);
  if (l.mtp && l.mtp->accepted_tokens_per_step) {
    line += fmt::format(", MTP {:.2f} accepted/step", *l.mtp->accepted_tokens_per_step);
  }
  if (l.prefill && l.prefill->compute_ms && l.prefill->kv_tail_ms) {
    line +=
        fmt::format(", prefill {:.2f} ms + KV tail {:.2f} ms a prompt", *l.prefill->compute_ms, *l.prefill->kv_tail_ms);
  }
  if (!l.errors.empty()) line += fmt::format(" (first error: {})", l.errors.front().message);
  return line;
}

}  // namespace pd::bench
