// The role supervisor (role_process.h) against shell scripts that play a role: READY lines,
// children that exit or never become ready, line forwarding, and stopping with a drain.
#include <gtest/gtest.h>
#include <signal.h>

#include <mutex>
#include <string>
#include <vector>

#include "pd/common/role_process.h"

namespace pd::proc {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<RoleProcess> role(const std::string& script, RoleProcessOptions o = {}) {
  o.argv = {"/bin/sh", "-c", script};
  auto child = RoleProcess::spawn(std::move(o));
  EXPECT_TRUE(child.ok()) << child.error().toString();
  return child.ok() ? std::move(*child) : nullptr;
}

TEST(ReadyLine, ParsesRoleAndUrlAndRejectsOtherLines) {
  auto r = parseReadyLine("PDSERVE_READY role=decode url=http://127.0.0.1:40123 node_rank=1");
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->role, "decode");
  EXPECT_EQ(r->url, "http://127.0.0.1:40123");
  EXPECT_FALSE(parseReadyLine("PDSERVE_READY role=decode").has_value());
  EXPECT_FALSE(parseReadyLine("PDSERVE_READY role=decode url=").has_value());
  EXPECT_FALSE(parseReadyLine("[decode] PDSERVE_READY role=decode url=http://h:1").has_value());
  EXPECT_FALSE(parseReadyLine("PDSERVE_CHILD name=decode-0 url=http://h:1").has_value());
  EXPECT_EQ(hostPortOf("http://10.0.0.1:80"), "10.0.0.1:80");
  EXPECT_EQ(hostPortOf("10.0.0.1:80"), "10.0.0.1:80");
}

TEST(RoleProcess, ReadyLineGivesTheAddressAndEveryLineIsForwarded) {
  std::mutex mutex;
  std::vector<std::string> lines;
  RoleProcessOptions o;
  o.capture_stderr = true;
  o.on_line = [&](OutputStream stream, const std::string& line) {
    std::lock_guard lock(mutex);
    lines.push_back((stream == OutputStream::Stdout ? "out:" : "err:") + line);
  };
  auto child = role(
      "trap 'echo draining; exit 0' TERM; echo loading; echo warn >&2; "
      "echo 'PDSERVE_READY role=prefill url=http://127.0.0.1:40999'; while :; do sleep 0.05; done",
      std::move(o));
  ASSERT_TRUE(child);
  ASSERT_TRUE(child->waitReady(30s).ok());
  EXPECT_TRUE(child->ready());
  EXPECT_EQ(child->url(), "http://127.0.0.1:40999");
  EXPECT_EQ(child->hostPort(), "127.0.0.1:40999");
  EXPECT_EQ(child->host(), "127.0.0.1");
  EXPECT_EQ(child->port(), 40999);
  EXPECT_EQ(child->stop(30s), 0) << "SIGTERM lets the role drain and exit 0";
  child.reset();  // joins the reader: every line is in
  // In order within each stream (two pipes: no order between them).
  std::vector<std::string> out;
  std::vector<std::string> err;
  for (const auto& l : lines) (l.starts_with("out:") ? out : err).push_back(l.substr(4));
  EXPECT_EQ(out,
            (std::vector<std::string>{"loading", "PDSERVE_READY role=prefill url=http://127.0.0.1:40999", "draining"}));
  EXPECT_EQ(err, (std::vector<std::string>{"warn"}));
}

TEST(RoleProcess, ExitBeforeReadyIsPeerFailedWithTheStatus) {
  auto child = role("echo starting; exit 7");
  ASSERT_TRUE(child);
  const Status s = child->waitReady(30s);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::PeerFailed);
  EXPECT_NE(s.error().message.find("status 7"), std::string::npos) << s.error().message;
  EXPECT_FALSE(child->ready());
  EXPECT_EQ(child->port(), 0);
}

TEST(RoleProcess, NoReadyLineWithinTheDeadlineIsTimeoutAndStopKillsAStubbornChild) {
  auto child = role("trap '' TERM; echo started; while :; do sleep 0.05; done");
  ASSERT_TRUE(child);
  const Status s = child->waitReady(300ms);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::Timeout);
  EXPECT_EQ(child->stop(200ms), std::nullopt) << "ignored SIGTERM: killed";
  EXPECT_EQ(child->poll(), 128 + SIGKILL) << "reaped by stop()";
  EXPECT_FALSE(child->signal(SIGTERM));
}

}  // namespace
}  // namespace pd::proc
