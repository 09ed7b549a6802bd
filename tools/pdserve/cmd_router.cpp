// pdserve router: the router process. Loads the tokenizer and chat template of the
// model (or model.tokenizer) folder, polls the prefill and decode workers of router.* (static
// lists and/or DNS service names), serves the OpenAI-compatible API (docs/api.md) over the P/D
// orchestrator, prints one PDSERVE_READY line on stdout when serving, and drains on SIGTERM /
// SIGINT: /ready turns 503 and new requests are refused (503) at once, requests in flight may
// finish for router.drain_timeout_ms, the rest are aborted (the workers are told), and the
// process exits 0. A second signal skips the wait.
// --check-config validates the options and exits (0, or 2 on a bad value) without loading
// anything.
#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <string_view>
#include <thread>

#include "cli.h"
#include "pd/common/internal_auth.h"
#include "pd/common/log.h"
#include "pd/common/metrics.h"
#include "pd/engine/model_config.h"
#include "pd/router/api_server.h"
#include "pd/router/pd_backend.h"
#include "pd/router/router_config.h"
#include "pd/router/tokenizer_prompt_renderer.h"
#include "pd/router/worker_policy.h"
#include "pd/router/worker_registry.h"
#include "pd/trace/tracer.h"

namespace pd::cli {
namespace {

constexpr std::string_view kLog = "router";

constexpr std::string_view kUsage =
    "usage: pdserve router [--config FILE] [--check-config] [--section.name value ...]\n"
    "Runs the OpenAI-compatible router: tokenizes requests, picks a prefill and a decode worker\n"
    "(router.prefill_workers / router.decode_workers as host:port lists, or router.prefill_service /\n"
    "router.decode_service as DNS name:port), and streams the decode worker's tokens to the client.\n"
    "Prints 'PDSERVE_READY role=router url=http://HOST:PORT' on stdout once serving. SIGTERM/SIGINT drains\n"
    "(router.drain_timeout_ms) and exits 0. --check-config validates the configuration and exits.";

// What the option tables alone cannot check.
Result<router::RegistryOptions> validate(const router::RouterConfig& cfg) {
  PD_ASSIGN_OR_RETURN(auto registry, router::registryOptionsFromConfig(cfg));
  if (registry.prefill_workers.empty() && !registry.prefill_service) {
    return makeError(ErrorCode::InvalidArgument,
                     "no prefill workers: set router.prefill_workers (host:port list) or router.prefill_service");
  }
  if (registry.decode_workers.empty() && !registry.decode_service) {
    return makeError(ErrorCode::InvalidArgument,
                     "no decode workers: set router.decode_workers (host:port list) or router.decode_service");
  }
  if (!router::isPrefillPolicy(cfg.prefill_policy)) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("unknown router.prefill_policy '{}'", cfg.prefill_policy));
  }
  return registry;
}

// Waits until the requests in flight are done, the drain timeout passes, or a second signal.
void drain(const router::ApiServer& api, const sigset_t& signals, std::chrono::milliseconds timeout) {
  const auto idle = [&] {
    if (api.inFlight() == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return api.inFlight() == 0;
  };
  waitForDrain(idle, signals, timeout, kLog, [&] { return fmt::format("{} request(s)", api.inFlight()); });
}

}  // namespace

int runRouter(const std::vector<std::string>& raw_args) {
  std::vector<std::string> args = raw_args;
  const bool check_only = takeCheckConfigFlag(args);
  CommonConfig common;
  CommonOptions common_sets(common);
  router::RouterConfig cfg;
  config::OptionSet router_set("router");
  router::registerOptions(router_set, cfg);
  auto loaded = loadCommandOptions(
      std::string(kUsage),
      {&router_set, &common_sets.log, &common_sets.model, &common_sets.cluster, &common_sets.trace}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, fmt::format("unexpected argument '{}'", loaded->positionals.front())));
  }
  auto registry_options = validate(cfg);
  if (!registry_options.ok()) return reportFailure(registry_options.error());
  if (check_only) return 0;

  // Signals are taken by sigwait on this thread: block them before any other thread exists.
  const sigset_t signals = blockStopSignals();

  for (const std::string& v : router_set.describeValues()) log::info(kLog, "router.{}", v);
  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  auto model_config = ModelConfig::load(*model_dir);
  if (!model_config.ok()) return reportFailure(model_config.error());
  const auto tokenizer_dir = common.tokenizer_path.empty() ? *model_dir : common.tokenizer_path;
  auto renderer = router::TokenizerPromptRenderer::load(tokenizer_dir);
  if (!renderer.ok()) return reportFailure(renderer.error());
  log::info(kLog, "model {} (context {} tokens), tokenizer {}", model_dir->string(),
            model_config->max_position_embeddings, tokenizer_dir.string());

  auto api_options = router::apiServerOptionsFromConfig(cfg, model_config->max_position_embeddings);
  if (!api_options.ok()) return reportFailure(api_options.error());
  if (Status s = router::configureOutput(*api_options, cfg, (*renderer)->tokenizer(),
                                         static_cast<std::size_t>(model_config->vocab_size));
      !s.ok()) {
    return reportFailure(s.error());
  }
  auto auth = loadInternalAuth(common.cluster_secret_file);
  if (!auth.ok()) return reportFailure(auth.error());
  if (!*auth) log::warn(kLog, "no cluster secret: calls to the workers are unsigned (docs/security.md)");
  registry_options->auth = *auth;
  metrics::Registry metrics;
  // Before everything that records spans: it goes last, exporting what is still queued.
  auto tracer = trace::Tracer::create(common.trace, "pdserve-router", &metrics);
  if (!tracer.ok()) return reportFailure(tracer.error());
  registry_options->metrics = &metrics;  // per-worker gauges on /metrics (the status page reads them)
  auto registry = router::WorkerRegistry::start(std::move(registry_options).value());
  if (!registry.ok()) return reportFailure(registry.error());
  router::PdBackendOptions backend_options = router::pdBackendOptionsFromConfig(cfg);
  backend_options.auth = *auth;
  backend_options.tracer = tracer->get();
  auto backend = router::PdBackend::create(std::move(backend_options), **registry, (*renderer)->tokenizer(), metrics);
  if (!backend.ok()) return reportFailure(backend.error());
  api_options->tracer = tracer->get();
  auto api = router::ApiServer::start(std::move(api_options).value(), **backend, **renderer, metrics);
  if (!api.ok()) return reportFailure(api.error());
  const std::string url = fmt::format("http://{}:{}", cfg.host, (*api)->port());
  log::info(kLog, "serving on {}", url);
  std::printf("PDSERVE_READY role=router url=%s\n", url.c_str());
  std::fflush(stdout);

  int sig = 0;
  if (sigwait(&signals, &sig) == 0) log::info(kLog, "signal {}: draining", sig);
  (*backend)->beginDrain();  // /ready 503 and new requests 503 from here on
  drain(**api, signals, std::chrono::milliseconds(cfg.drain_timeout_ms));
  (*api)->stop(std::chrono::milliseconds(0));  // cuts what is left: their generations are aborted
  backend->reset();                            // joins generation threads (the workers were told)
  registry->reset();
  log::info(kLog, "stopped");
  return 0;
}

}  // namespace pd::cli
