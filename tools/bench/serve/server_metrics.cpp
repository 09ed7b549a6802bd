// Prometheus text scraping for `pdserve bench serve` (server_metrics.h).
#include "bench/serve/server_metrics.h"

#include <charconv>
#include <cmath>
#include <cstdlib>

#include "bench/serve/runner.h"
#include "pd/common/http_client.h"

namespace pd::bench {

std::map<std::string, double> parsePrometheusText(std::string_view text) {
  std::map<std::string, double> sums;
  std::size_t pos = 0;
  while (pos < text.size()) {
    auto eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line.front() == '#') continue;
    const auto name_end = line.find_first_of("{ \t");
    if (name_end == std::string_view::npos || name_end == 0) continue;
    const std::string name(line.substr(0, name_end));
    std::string_view rest = line.substr(name_end);
    std::string labelled;  // name{labels} as written, for a labelled sample
    if (rest.front() == '{') {
      // Label values may contain '}' inside quotes; find the closing brace outside them.
      bool quoted = false;
      std::size_t i = 1;
      for (; i < rest.size(); ++i) {
        if (rest[i] == '\\' && quoted) {
          ++i;
        } else if (rest[i] == '"') {
          quoted = !quoted;
        } else if (rest[i] == '}' && !quoted) {
          break;
        }
      }
      if (i >= rest.size()) continue;
      labelled = name + std::string(rest.substr(0, i + 1));
      rest = rest.substr(i + 1);
    }
    const auto value_begin = rest.find_first_not_of(" \t");
    if (value_begin == std::string_view::npos) continue;
    rest = rest.substr(value_begin);
    const std::string value_text(rest.substr(0, rest.find_first_of(" \t")));
    char* end = nullptr;
    const double value = std::strtod(value_text.c_str(), &end);
    if (end == value_text.c_str() || *end != '\0' || !std::isfinite(value)) continue;
    sums[name] += value;
    if (!labelled.empty()) sums[labelled] += value;
  }
  return sums;
}

Result<std::map<std::string, double>> scrapeCounters(const std::vector<std::string>& urls,
                                                     std::chrono::milliseconds timeout) {
  std::map<std::string, double> total;
  for (const auto& url : urls) {
    PD_ASSIGN_OR_RETURN(auto target, parseUrl(url));
    http::Client client(target.host, target.port);
    http::ClientRequest req;
    req.target = target.prefix.empty() ? "/metrics" : target.prefix;
    PD_ASSIGN_OR_RETURN(auto response, client.send(req, timeout));
    if (response.status != 200) {
      return makeError(ErrorCode::PeerFailed, url + ": /metrics answered HTTP " + std::to_string(response.status));
    }
    for (const auto& [name, value] : parsePrometheusText(response.body)) total[name] += value;
  }
  return total;
}

std::optional<double> counterDelta(const std::map<std::string, double>& before,
                                   const std::map<std::string, double>& after, std::string_view name) {
  const auto a = after.find(std::string(name));
  if (a == after.end()) return std::nullopt;
  const auto b = before.find(std::string(name));
  return a->second - (b == before.end() ? 0.0 : b->second);
}

std::optional<PrefillServerStats> prefillFromDeltas(const std::map<std::string, double>& before,
                                                    const std::map<std::string, double>& after) {
  const auto delta = [&](std::string_view name) { return counterDelta(before, after, name); };
  const auto prompts = delta("pdserve_prefill_compute_seconds_count");
  if (!prompts || !(*prompts > 0)) return std::nullopt;
  PrefillServerStats p;
  p.prompts = *prompts;
  // The mean of one histogram over the level: its sum's growth over its count's growth, in ms.
  const auto mean_ms = [&](const std::string& stem, const std::string& labels) -> std::optional<double> {
    const auto sum = delta(stem + "_sum" + labels);
    const auto count = delta(stem + "_count" + labels);
    if (!sum || !count || !(*count > 0)) return std::nullopt;
    return *sum / *count * 1e3;
  };
  p.queue_ms = mean_ms("pdserve_prefill_queue_seconds", "");
  p.compute_ms = mean_ms("pdserve_prefill_compute_seconds", "");
  p.kv_tail_ms = mean_ms("pdserve_prefill_transfer_seconds", "");
  p.kv_transfer_ms = mean_ms("pdserve_kv_transfer_seconds", "{side=\"send\"}");
  if (const auto bytes = delta("pdserve_kv_put_bytes_total")) p.kv_bytes = *bytes / p.prompts;
  return p;
}

}  // namespace pd::bench
