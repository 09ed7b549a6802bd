#pragma once
// A whole local pdserve cluster for end-to-end tests: the real `pdserve up` binary (router +
// prefill + decode child processes, real HTTP, real UCX), started with the given flags; the
// router's address comes from up's PDSERVE_READY line. Its log goes to the test's stderr. The
// cluster signs its internal calls with a secret of the test's (auth()), so tests can call the
// workers' internal endpoints as the router does.
// Also small helpers to talk to it over HTTP.
// Thread rules: one owner thread; the proc::RoleProcess reader thread drains up's stdout.

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/internal_auth.h"
#include "pd/common/role_process.h"
#include "pd/common/worker_api.h"
#include "support/test_files.h"

namespace pd::test {

class LocalCluster {
 public:
  /// Starts `pdserve up` with `flags` and waits up to `timeout` for it to be ready; on failure
  /// the test fails and url() is empty. With `capture_stderr` up's log (its children's too) is
  /// kept for stderrLines() instead of going to the test's stderr.
  explicit LocalCluster(std::vector<std::string> flags, std::chrono::seconds timeout = std::chrono::seconds{180},
                        bool capture_stderr = false) {
    proc::RoleProcessOptions o;
    o.capture_stderr = capture_stderr;
    o.argv = {PD_PDSERVE_BIN, "up"};
    if (Status s = writeNewClusterSecret(secret_dir_.path() / "secret"); !s.ok()) ADD_FAILURE() << s.error().toString();
    auto auth = loadInternalAuth(secret_dir_.path() / "secret");
    if (auth.ok()) auth_ = *auth;
    o.argv.push_back("--cluster.secret_file=" + (secret_dir_.path() / "secret").string());
    o.argv.insert(o.argv.end(), flags.begin(), flags.end());
    o.on_line = [this](proc::OutputStream stream, const std::string& line) {
      std::lock_guard lock(mutex_);
      (stream == proc::OutputStream::Stderr ? err_lines_ : lines_).push_back(line);
    };
    auto child = proc::RoleProcess::spawn(std::move(o));
    if (!child.ok()) {
      ADD_FAILURE() << child.error().toString();
      return;
    }
    process_ = std::move(*child);
    if (Status s = process_->waitReady(timeout); !s.ok()) ADD_FAILURE() << s.error().toString();
  }
  ~LocalCluster() {
    if (process_ && !process_->poll()) {
      process_->signal(SIGTERM);
      if (!process_->wait(std::chrono::seconds{60})) ADD_FAILURE() << "pdserve up did not stop within 60 s";
    }
    process_.reset();  // kills a straggler, joins the reader before lines_ goes
  }
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;
  LocalCluster(LocalCluster&&) = delete;
  LocalCluster& operator=(LocalCluster&&) = delete;

  /// "http://127.0.0.1:PORT" of the router; empty until up is ready.
  [[nodiscard]] std::string url() const { return process_ ? process_->url() : std::string(); }
  [[nodiscard]] std::string host() const { return "127.0.0.1"; }
  [[nodiscard]] std::uint16_t port() const { return process_ ? process_->port() : 0; }
  [[nodiscard]] int pid() const { return process_ ? static_cast<int>(process_->pid()) : -1; }
  /// SIGTERM to `up`; its exit status within `timeout` (nullopt if it did not exit).
  std::optional<int> stop(std::chrono::milliseconds timeout) {
    if (!process_) return std::nullopt;
    process_->signal(SIGTERM);
    return process_->wait(timeout);
  }
  /// up's exit status once it exits by itself within `timeout` (nullopt if it did not).
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    return process_ ? process_->wait(timeout) : std::nullopt;
  }
  /// Signs calls to the cluster's workers (signRequest(auth().get(), ...)).
  [[nodiscard]] const std::shared_ptr<InternalAuth>& auth() const { return auth_; }
  /// Every line up printed on stdout so far.
  [[nodiscard]] std::vector<std::string> stdoutLines() const {
    std::lock_guard lock(mutex_);
    return lines_;
  }
  /// Every line up printed on stderr so far (with capture_stderr).
  [[nodiscard]] std::vector<std::string> stderrLines() const {
    std::lock_guard lock(mutex_);
    return err_lines_;
  }

 private:
  TempDir secret_dir_;
  std::shared_ptr<InternalAuth> auth_;
  mutable std::mutex mutex_;
  std::vector<std::string> lines_;      // guarded by mutex_; filled by the process's reader thread
  std::vector<std::string> err_lines_;  // guarded by mutex_; likewise, with capture_stderr
  std::unique_ptr<proc::RoleProcess> process_;
};

/// POSTs a JSON body to the router; the whole response.
// The host:port of up's children of `role` ("prefill", "decode"), from its PDSERVE_CHILD lines.
inline std::vector<std::string> childUrls(const LocalCluster& cluster, const std::string& role) {
  std::vector<std::string> out;
  const std::string prefix = "PDSERVE_CHILD name=" + role + "-";
  for (const auto& line : cluster.stdoutLines()) {
    if (!line.starts_with(prefix)) continue;
    const auto pos = line.find("url=http://");
    if (pos != std::string::npos) out.push_back(line.substr(pos + 11));
  }
  return out;
}

inline http::ClientResponse postJson(const LocalCluster& cluster, const std::string& path, const std::string& body,
                                     std::chrono::seconds timeout = std::chrono::seconds{120}) {
  http::Client client(cluster.host(), cluster.port());
  http::ClientRequest req;
  req.method = "POST";
  req.target = path;
  req.headers.push_back({"Content-Type", "application/json"});
  req.body = body;
  auto r = client.send(req, timeout);
  if (!r.ok()) {
    ADD_FAILURE() << "POST " << path << ": " << r.error().toString();
    return {};
  }
  return std::move(*r);
}

/// GET `path`, signed with `auth` when given (a worker's internal endpoints).
inline http::ClientResponse getPath(const std::string& host, std::uint16_t port, const std::string& path,
                                    const InternalAuth* auth = nullptr) {
  http::Client client(host, port);
  http::ClientRequest req;
  req.target = path;
  signRequest(auth, req.method, req.target, req.body, req.headers);
  auto r = client.send(req, std::chrono::seconds{30});
  if (!r.ok()) {
    ADD_FAILURE() << "GET " << path << ": " << r.error().toString();
    return {};
  }
  return std::move(*r);
}

// A child worker's /v1/internal/status ("host:port" as childUrls gives it), signed with `auth`; a
// failure, and an empty status, unless it answers 200 with a valid status.
inline worker_api::WorkerStatus workerStatus(const std::string& host_port, const InternalAuth* auth) {
  const auto colon = host_port.rfind(':');
  auto r = getPath(host_port.substr(0, colon), static_cast<std::uint16_t>(std::stoi(host_port.substr(colon + 1))),
                   std::string(worker_api::kStatusPath), auth);
  EXPECT_EQ(r.status, 200);
  auto st = worker_api::parseWorkerStatus(r.body);
  EXPECT_TRUE(st.ok()) << (st.ok() ? "" : st.error().toString());
  return st.ok() ? *st : worker_api::WorkerStatus{};
}

}  // namespace pd::test
