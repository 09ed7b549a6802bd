// The self-healing supervisor of `pdserve up` (cluster_supervisor.h).
#include "cluster/cluster_supervisor.h"

#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "pd/common/http_client.h"
#include "pd/common/log.h"
#include "pd/common/log_format.h"

namespace pd::cluster {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::string_view kLog = "up";

std::string joinedHostPorts(const std::vector<std::string>& urls) {
  std::string out;
  for (const auto& u : urls) {
    if (!out.empty()) out += ',';
    out += proc::hostPortOf(u);
  }
  return out;
}

}  // namespace

std::chrono::milliseconds restartDelay(const RestartPolicy& policy, std::size_t recent) {
  auto delay = policy.backoff_initial;
  for (std::size_t i = 0; i < recent && delay < policy.backoff_max; ++i) delay *= 2;
  return std::min(delay, policy.backoff_max);
}

ClusterSupervisor::ClusterSupervisor(ClusterOptions options, const std::atomic<int>& stop_requested, int wake_fd)
    : options_(std::move(options)), stop_requested_(stop_requested), wake_fd_(wake_fd) {}

ClusterSupervisor::~ClusterSupervisor() = default;  // each RoleProcess kills its child

Status ClusterSupervisor::spawn(Child& child) {
  proc::RoleProcessOptions o;
  o.argv = {options_.executable};
  o.argv.insert(o.argv.end(), child.args.begin(), child.args.end());
  if (child.port != 0) o.argv.push_back(child.port_flag + "=" + std::to_string(child.port));
  // glibc's malloc asks for transparent huge pages on the large blocks (the KV pool, the
  // tokenizer's tables, sliced weights): on the 2-core machine the whole cluster then started in
  // 2.1 s instead of 3.1 s, with 2.8 CPU-s instead of 4.3 (a third of the page faults gone). A
  // GLIBC_TUNABLES of the caller's own is kept as it is.
  if (std::getenv("GLIBC_TUNABLES") == nullptr) o.env.emplace_back("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1");
  o.capture_stderr = true;
  o.on_line = [name = child.name](proc::OutputStream stream, const std::string& line) {
    if (stream == proc::OutputStream::Stdout && line.starts_with(proc::kReadyPrefix)) return;  // announced instead
    std::FILE* out = stream == proc::OutputStream::Stdout ? stdout : stderr;
    if (stream == proc::OutputStream::Stderr && log::format() == log::Format::Json) {
      // One JSON object per line: the child's own, with its name added, or its stray text wrapped.
      if (line.starts_with('{')) {
        std::fprintf(out, "{\"process\":\"%s\",%s\n", name.c_str(), line.c_str() + 1);
      } else {
        const auto now = std::chrono::system_clock::now().time_since_epoch();
        const std::string wrapped = log::formatLine(std::chrono::duration_cast<std::chrono::milliseconds>(now).count(),
                                                    log::Level::Info, name, line);
        std::fprintf(out, "%s\n", wrapped.c_str());
      }
      std::fflush(out);
      return;
    }
    std::fprintf(out, "[%s] %s\n", name.c_str(), line.c_str());
    std::fflush(out);
  };
  PD_ASSIGN_OR_RETURN(child.process, proc::RoleProcess::spawn(std::move(o)));
  child.announced = false;
  child.ready_deadline = Clock::now() + options_.ready_timeout;
  return okStatus();
}

void ClusterSupervisor::announceIfReady(Child& child) {
  if (child.announced || !child.process->ready()) return;
  child.announced = true;
  const bool restarted = child.port != 0;
  if (!restarted && !child.port_flag.empty()) child.port = child.process->port();
  log::info(kLog, "{} {} {}", child.name, restarted ? "is back at" : "ready at", child.process->url());
  std::printf("PDSERVE_CHILD name=%s pid=%d url=%s\n", child.name.c_str(), static_cast<int>(child.process->pid()),
              child.process->url().c_str());
  std::fflush(stdout);
}

Status ClusterSupervisor::checkStarting() {
  for (auto& c : children_) {
    if (!c->process) continue;
    announceIfReady(*c);
    if (auto status = c->process->poll()) {
      return makeError(ErrorCode::PeerFailed, c->name + " exited with status " + std::to_string(*status));
    }
  }
  return okStatus();
}

bool ClusterSupervisor::sleepFor(std::chrono::milliseconds timeout) {
  if (stop_requested_.load() > 0) return true;
  if (wake_fd_ >= 0) {
    pollfd p{wake_fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) > 0) {
      char buf[16];
      [[maybe_unused]] const auto n = ::read(wake_fd_, buf, sizeof buf);
    }
  } else {
    ::poll(nullptr, 0, static_cast<int>(timeout.count()));
  }
  return stop_requested_.load() > 0;
}

Status ClusterSupervisor::waitAllReady(const std::vector<Child*>& children) {
  const auto deadline = Clock::now() + options_.ready_timeout;
  while (true) {
    PD_TRY(checkStarting());
    if (std::all_of(children.begin(), children.end(), [](const Child* c) { return c->announced; })) {
      return okStatus();
    }
    if (Clock::now() >= deadline) {
      return makeError(ErrorCode::Timeout,
                       "processes not ready within " + std::to_string(options_.ready_timeout.count()) + " ms");
    }
    if (sleepFor(100ms)) return makeError(ErrorCode::Cancelled, "interrupted while starting");
  }
}

// The router listens before its first health polls have put the workers in rotation; the
// cluster is ready once the router's /ready says so.
Status ClusterSupervisor::waitRouterReady(const std::string& url) {
  const std::string hp = proc::hostPortOf(url);
  const auto colon = hp.rfind(':');
  http::Client client(hp.substr(0, colon), static_cast<std::uint16_t>(std::stoi(hp.substr(colon + 1))));
  const auto deadline = Clock::now() + options_.ready_timeout;
  while (true) {
    http::ClientRequest req;
    req.target = "/ready";
    auto r = client.send(req, 2s);
    if (r.ok() && r->status == 200) return okStatus();
    if (!r.ok()) client.disconnect();
    PD_TRY(checkStarting());
    if (Clock::now() >= deadline) {
      return makeError(ErrorCode::Timeout, "the router did not report ready within " +
                                               std::to_string(options_.ready_timeout.count()) +
                                               " ms (are the workers healthy?)");
    }
    if (sleepFor(100ms)) return makeError(ErrorCode::Cancelled, "interrupted while starting");
  }
}

Result<std::string> ClusterSupervisor::start() {
  std::vector<Child*> workers;
  const auto add = [&](std::string name, const std::string& role, std::string port_flag) {
    auto c = std::make_unique<Child>();
    c->name = std::move(name);
    c->args = {role};
    c->args.insert(c->args.end(), options_.common_flags.begin(), options_.common_flags.end());
    const auto& own = role == "prefill" ? options_.prefill_flags : options_.decode_flags;
    c->args.insert(c->args.end(), own.begin(), own.end());
    c->port_flag = std::move(port_flag);
    children_.push_back(std::move(c));
    return children_.back().get();
  };
  workers.reserve(static_cast<std::size_t>(options_.decode_workers + options_.prefill_workers));
  for (std::int64_t i = 0; i < options_.decode_workers; ++i) {
    workers.push_back(add("decode-" + std::to_string(i), "decode", "--decode.port"));
  }
  for (std::int64_t i = 0; i < options_.prefill_workers; ++i) {
    workers.push_back(add("prefill-" + std::to_string(i), "prefill", "--prefill.port"));
  }
  for (Child* w : workers) PD_TRY(spawn(*w));
  PD_TRY(waitAllReady(workers));

  std::vector<std::string> prefill_urls;
  std::vector<std::string> decode_urls;
  for (const Child* w : workers) {
    (w->name.starts_with("prefill") ? prefill_urls : decode_urls).push_back(w->process->url());
  }
  Child* router = add("router", "router", "");
  router->args.insert(router->args.end(), options_.router_flags.begin(), options_.router_flags.end());
  router->args.push_back("--router.prefill_workers=" + joinedHostPorts(prefill_urls));
  router->args.push_back("--router.decode_workers=" + joinedHostPorts(decode_urls));
  PD_TRY(spawn(*router));
  PD_TRY(waitAllReady({router}));
  const std::string url = router->process->url();
  PD_TRY(waitRouterReady(url));
  return url;
}

Status ClusterSupervisor::scheduleRestart(Child& child, const std::string& why) {
  child.process.reset();
  const auto now = Clock::now();
  while (!child.restarts.empty() && now - child.restarts.front() > options_.restart.window) child.restarts.pop_front();
  if (static_cast<std::int64_t>(child.restarts.size()) >= options_.restart.budget) {
    return makeError(ErrorCode::PeerFailed,
                     fmt::format("{} {}; its restart budget ({} in {} s) is spent", child.name, why,
                                 options_.restart.budget, options_.restart.window.count() / 1000));
  }
  const auto delay = restartDelay(options_.restart, child.restarts.size());
  child.restarts.push_back(now + delay);
  child.restart_at = now + delay;
  log::warn(kLog, "{} {}: restarting it on port {} in {} ms (restart {} of {} within {} s)", child.name, why,
            child.port, delay.count(), child.restarts.size(), options_.restart.budget,
            options_.restart.window.count() / 1000);
  return okStatus();
}

Status ClusterSupervisor::superviseUntilStopped() {
  while (!sleepFor(100ms)) {
    const auto now = Clock::now();
    for (auto& c : children_) {
      if (!c->process) {
        if (now < c->restart_at) continue;
        if (Status s = spawn(*c); !s.ok()) {
          PD_TRY(scheduleRestart(*c, "could not start (" + s.error().toString() + ")"));
        }
        continue;
      }
      announceIfReady(*c);
      if (auto status = c->process->poll()) {
        const std::string why = "exited with status " + std::to_string(*status);
        if (c->port_flag.empty()) return makeError(ErrorCode::PeerFailed, c->name + " " + why);
        PD_TRY(scheduleRestart(*c, why));
      } else if (!c->announced && now >= c->ready_deadline) {
        c->process->signal(SIGKILL);
        c->process->wait(10s);
        PD_TRY(scheduleRestart(*c, "was not ready within " + std::to_string(options_.ready_timeout.count()) + " ms"));
      }
    }
  }
  return okStatus();
}

void ClusterSupervisor::stopGroup(const std::string& prefix) {
  std::vector<Child*> group;
  for (auto& c : children_) {
    if (c->name.starts_with(prefix) && c->process && !c->process->poll()) group.push_back(c.get());
  }
  for (Child* c : group) {
    c->process->signal(SIGCONT);
    c->process->signal(SIGTERM);
  }
  const auto deadline = Clock::now() + options_.stop_timeout;
  for (Child* c : group) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (c->process->wait(std::max(left, 0ms))) continue;
    log::warn(kLog, "{} did not stop within {} ms: killing it", c->name, options_.stop_timeout.count());
    c->process->signal(SIGKILL);
    c->process->wait(10s);
  }
}

void ClusterSupervisor::stopAll() {
  stopGroup("router");
  stopGroup("prefill");
  stopGroup("decode");
}

}  // namespace pd::cluster
