#pragma once
// One pdserve role process (`pdserve router|prefill|decode ...`) for end-to-end and fault tests:
// started with flags, ready once it prints its PDSERVE_READY line (which gives its URL), and
// signalled or killed by the test. Unlike `pdserve up` (which stops the whole cluster when one
// process dies) a test can kill one worker and watch the others cope. Its stderr goes to the
// test's stderr, prefixed through nothing (the role's log lines carry the role name).
// Thread rules: one owner thread; a background thread drains stdout.

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

#include "pd/common/subprocess.h"

namespace pd::test {

class RoleProcess {
 public:
  /// Starts the process and waits up to `timeout` for its READY line (a test failure if it does
  /// not come); timeout 0 returns at once (call waitReady() later: processes that only become
  /// ready together, like the nodes of one tensor-parallel group).
  RoleProcess(const std::string& role, std::vector<std::string> flags,
              std::chrono::seconds timeout = std::chrono::seconds{120})
      : role_(role) {
    std::vector<std::string> argv = {PD_PDSERVE_BIN, role};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto child = proc::Subprocess::spawn({argv, {}, true, false});
    if (!child.ok()) {
      ADD_FAILURE() << child.error().toString();
      return;
    }
    process_ = std::move(*child);
    reader_ = std::thread([this] { readStdout(); });
    if (timeout.count() > 0) waitReady(timeout);
  }
  /// Waits for the READY line; false (and a test failure) if it did not come within `timeout`.
  bool waitReady(std::chrono::seconds timeout = std::chrono::seconds{120}) {
    std::unique_lock lock(mutex_);
    if (!ready_.wait_for(lock, timeout, [this] { return !url_.empty() || closed_; }) || url_.empty()) {
      ADD_FAILURE() << "pdserve " << role_ << " did not become ready within " << timeout.count() << " s";
      return false;
    }
    return true;
  }
  ~RoleProcess() {
    if (process_ && !process_->poll()) {
      process_->signal(SIGCONT);
      process_->signal(SIGTERM);
      if (!process_->wait(std::chrono::seconds{60})) ADD_FAILURE() << "pdserve " << role_ << " did not stop in 60 s";
    }
    process_.reset();
    if (reader_.joinable()) reader_.join();
  }
  RoleProcess(const RoleProcess&) = delete;
  RoleProcess& operator=(const RoleProcess&) = delete;
  RoleProcess(RoleProcess&&) = delete;
  RoleProcess& operator=(RoleProcess&&) = delete;

  [[nodiscard]] bool ready() const { return !hostPort().empty(); }
  /// "127.0.0.1:40123"
  [[nodiscard]] std::string hostPort() const {
    std::lock_guard lock(mutex_);
    constexpr std::string_view scheme = "http://";
    return url_.starts_with(scheme) ? url_.substr(scheme.size()) : url_;
  }
  [[nodiscard]] std::string host() const {
    const auto hp = hostPort();
    return hp.substr(0, hp.rfind(':'));
  }
  [[nodiscard]] std::uint16_t port() const {
    const auto hp = hostPort();
    const auto colon = hp.rfind(':');
    return colon == std::string::npos ? 0 : static_cast<std::uint16_t>(std::stoi(hp.substr(colon + 1)));
  }
  [[nodiscard]] int pid() const { return process_ ? static_cast<int>(process_->pid()) : -1; }
  bool signal(int sig) { return process_ && process_->signal(sig); }
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    return process_ ? process_->wait(timeout) : std::nullopt;
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
      constexpr std::string_view kReady = "PDSERVE_READY ";
      if (!line->starts_with(kReady)) continue;
      const auto pos = line->find("url=");
      if (pos == std::string::npos) continue;
      std::lock_guard lock(mutex_);
      url_ = line->substr(pos + 4);
      url_ = url_.substr(0, url_.find(' '));
      ready_.notify_all();
    }
    std::lock_guard lock(mutex_);
    closed_ = true;
    ready_.notify_all();
  }

  std::string role_;
  std::unique_ptr<proc::Subprocess> process_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::string url_;      // guarded by mutex_
  bool closed_ = false;  // guarded by mutex_
  std::thread reader_;
};

}  // namespace pd::test
