#include "pd/common/probe_routes.h"

#include <memory>
#include <utility>

#include "pd/common/json_text.h"
#include "pd/common/metrics.h"
#include "pd/common/worker_api.h"

namespace pd::http {
namespace {

Response probeAnswer(Probes::Format format, int status, const std::string& text) {
  if (format == Probes::Format::Json) {
    return Response::withBody(status, "application/json", "{\"status\":" + jsonString(text) + "}");
  }
  return Response::withBody(status, "text/plain; charset=utf-8", text);
}

}  // namespace

void addProbeRoutes(std::vector<Route>& routes, Probes probes) {
  // Shared by the handlers, which outlive this call.
  auto shared = std::make_shared<const Probes>(std::move(probes));
  routes.push_back({"GET", "/health",
                    [shared](const Request&, Exchange ex) { ex.respond(probeAnswer(shared->format, 200, "ok")); }});
  routes.push_back({"GET", "/ready", [shared](const Request&, Exchange ex) {
                      const std::string reason = shared->not_ready ? shared->not_ready() : std::string();
                      ex.respond(probeAnswer(shared->format, reason.empty() ? 200 : 503,
                                             reason.empty() ? std::string("ready") : reason));
                    }});
  if (shared->metrics) {
    routes.push_back({"GET", "/metrics", [shared](const Request&, Exchange ex) {
                        ex.respond(
                            Response::withBody(200, std::string(metrics::kExpositionContentType), shared->metrics()));
                      }});
  }
  if (shared->status) {
    routes.push_back({"GET", std::string(worker_api::kStatusPath), [shared](const Request&, Exchange ex) {
                        ex.respond(Response::withBody(200, "application/json", shared->status()));
                      }});
  }
}

}  // namespace pd::http
