#pragma once
/// The router's live status page (docs/observability.md, "Status page"): GET / serves the HTML
/// and GET /status.js its script, both compiled into the binary (no build step, nothing fetched
/// from elsewhere: the Content-Security-Policy allows this origin only).
///
/// The page holds no data of its own. It reads the router's /metrics every 1.5 s (per-worker
/// rotation, queue and KV use from the worker registry's gauges; request rate, TTFT and TPOT
/// percentiles from the router's histograms; MTP acceptance from the decode workers' draft counts)
/// and draws them on canvases, and streams a chat from /v1/chat/completions. When the router has
/// API keys, the page asks for one, checks it against /v1/models and shows nothing until it is
/// accepted; the key stays in the tab's sessionStorage and goes only to this origin.
///
/// Thread rules: pure functions; the handlers they return are thread-safe.

#include <string_view>
#include <vector>

#include "pd/common/http_server.h"

namespace pd::router {

/// GET / and GET /status.js.
[[nodiscard]] std::vector<http::Route> statusPageRoutes();

/// The page and its script (tests).
[[nodiscard]] std::string_view statusPageHtml();
[[nodiscard]] std::string_view statusPageScript();

}  // namespace pd::router
