#pragma once
// A whole local pdserve cluster for end-to-end tests: the real `pdserve up` binary (router +
// prefill + decode child processes, real HTTP, real UCX), started with the given flags; the
// router's address comes from up's PDSERVE_READY line. Its log goes to the test's stderr.
// Also small helpers to talk to it over HTTP.
// Thread rules: one owner thread; a background thread drains up's stdout.

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/subprocess.h"

namespace pd::test {

class LocalCluster {
 public:
  /// Starts `pdserve up` with `flags` and waits up to `timeout` for it to be ready; on failure
  /// the test fails and url() is empty.
  explicit LocalCluster(std::vector<std::string> flags, std::chrono::seconds timeout = std::chrono::seconds{180}) {
    std::vector<std::string> argv = {PD_PDSERVE_BIN, "up"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    proc::SpawnOptions options{argv, {}, true, false};
    auto child = proc::Subprocess::spawn(options);
    if (!child.ok()) {
      ADD_FAILURE() << child.error().toString();
      return;
    }
    process_ = std::move(*child);
    reader_ = std::thread([this] { readStdout(); });
    std::unique_lock lock(mutex_);
    if (!ready_.wait_for(lock, timeout, [this] { return !url_.empty() || stdout_closed_; }) || url_.empty()) {
      ADD_FAILURE() << "pdserve up did not become ready within " << timeout.count() << " s";
    }
  }
  ~LocalCluster() {
    if (process_ && !process_->poll()) {
      process_->signal(SIGTERM);
      if (!process_->wait(std::chrono::seconds{60})) ADD_FAILURE() << "pdserve up did not stop within 60 s";
    }
    process_.reset();  // kills a straggler, closes the pipe
    if (reader_.joinable()) reader_.join();
  }
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;
  LocalCluster(LocalCluster&&) = delete;
  LocalCluster& operator=(LocalCluster&&) = delete;

  [[nodiscard]] std::string url() const {
    std::lock_guard lock(mutex_);
    return url_;
  }
  [[nodiscard]] std::string host() const { return "127.0.0.1"; }
  [[nodiscard]] std::uint16_t port() const {
    const std::string u = url();
    const auto colon = u.rfind(':');
    return colon == std::string::npos ? 0 : static_cast<std::uint16_t>(std::stoi(u.substr(colon + 1)));
  }
  /// SIGTERM to `up`; its exit status within `timeout` (nullopt if it did not exit).
  std::optional<int> stop(std::chrono::milliseconds timeout) {
    if (!process_) return std::nullopt;
    process_->signal(SIGTERM);
    return process_->wait(timeout);
  }
  /// Every line up printed on stdout so far.
  [[nodiscard]] std::vector<std::string> stdoutLines() const {
    std::lock_guard lock(mutex_);
    return lines_;
  }

 private:
  void readStdout() {
    proc::LineReader reader(process_->stdoutFd());
    while (true) {
      auto line = reader.next(std::chrono::milliseconds{200});
      if (!line) {
        if (reader.eof()) break;
        continue;
      }
      std::lock_guard lock(mutex_);
      lines_.push_back(*line);
      constexpr std::string_view kReady = "PDSERVE_READY role=up url=";
      if (line->starts_with(kReady)) {
        url_ = line->substr(kReady.size());
        ready_.notify_all();
      }
    }
    std::lock_guard lock(mutex_);
    stdout_closed_ = true;
    ready_.notify_all();
  }

  std::unique_ptr<proc::Subprocess> process_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::string url_;                 // guarded by mutex_
  std::vector<std::string> lines_;  // guarded by mutex_
  bool stdout_closed_ = false;      // guarded by mutex_
  std::thread reader_;
};

/// POSTs a JSON body to the router; the whole response.
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

inline http::ClientResponse getPath(const std::string& host, std::uint16_t port, const std::string& path) {
  http::Client client(host, port);
  http::ClientRequest req;
  req.target = path;
  auto r = client.send(req, std::chrono::seconds{30});
  if (!r.ok()) {
    ADD_FAILURE() << "GET " << path << ": " << r.error().toString();
    return {};
  }
  return std::move(*r);
}

}  // namespace pd::test
