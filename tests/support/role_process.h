#pragma once
// One pdserve role process (`pdserve router|prefill|decode ...`) for end-to-end and fault tests:
// started with flags, ready once it prints its PDSERVE_READY line (which gives its URL), and
// signalled or killed by the test, which can kill one worker and watch the others cope. The
// supervision is proc::RoleProcess (pd/common/role_process.h); its stderr goes to the test's
// stderr (the role's log lines carry the role name).
// Thread rules: one owner thread; the RoleProcess's reader thread drains stdout.

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/role_process.h"

namespace pd::test {

/// gtest's view of a proc::RoleProcess running PD_PDSERVE_BIN: failures to start or become ready
/// are test failures, and the destructor drains the process (SIGCONT + SIGTERM, 60 s).
class RoleProcess {
 public:
  /// Starts the process and waits up to `timeout` for its READY line (a test failure if it does
  /// not come); timeout 0 returns at once (call waitReady() later: processes that only become
  /// ready together, like the nodes of one tensor-parallel group).
  RoleProcess(const std::string& role, std::vector<std::string> flags,
              std::chrono::seconds timeout = std::chrono::seconds{120})
      : role_(role) {
    proc::RoleProcessOptions o;
    o.argv = {PD_PDSERVE_BIN, role};
    o.argv.insert(o.argv.end(), flags.begin(), flags.end());
    auto child = proc::RoleProcess::spawn(std::move(o));
    if (!child.ok()) {
      ADD_FAILURE() << child.error().toString();
      return;
    }
    process_ = std::move(*child);
    if (timeout.count() > 0) waitReady(timeout);
  }
  /// Waits for the READY line; false (and a test failure) if it did not come within `timeout`.
  bool waitReady(std::chrono::seconds timeout = std::chrono::seconds{120}) {
    if (!process_) return false;
    if (Status s = process_->waitReady(timeout); !s.ok()) {
      ADD_FAILURE() << s.error().toString();
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
  }
  RoleProcess(const RoleProcess&) = delete;
  RoleProcess& operator=(const RoleProcess&) = delete;
  RoleProcess(RoleProcess&&) = delete;
  RoleProcess& operator=(RoleProcess&&) = delete;

  [[nodiscard]] bool ready() const { return process_ && process_->ready(); }
  /// "127.0.0.1:40123"
  [[nodiscard]] std::string hostPort() const { return process_ ? process_->hostPort() : std::string(); }
  [[nodiscard]] std::string host() const { return process_ ? process_->host() : std::string(); }
  [[nodiscard]] std::uint16_t port() const { return process_ ? process_->port() : 0; }
  [[nodiscard]] int pid() const { return process_ ? static_cast<int>(process_->pid()) : -1; }
  bool signal(int sig) { return process_ && process_->signal(sig); }
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    return process_ ? process_->wait(timeout) : std::nullopt;
  }

 private:
  std::string role_;
  std::unique_ptr<proc::RoleProcess> process_;
};

}  // namespace pd::test
