// Child processes (subprocess.h): output capture, exit codes, signals, environment.
#include <gtest/gtest.h>
#include <signal.h>

#include "pd/common/subprocess.h"

namespace pd::proc {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<Subprocess> shell(const std::string& script,
                                  std::vector<std::pair<std::string, std::string>> env = {}) {
  auto child = Subprocess::spawn({{"/bin/sh", "-c", script}, std::move(env)});
  EXPECT_TRUE(child.ok()) << child.error().toString();
  return child.ok() ? std::move(*child) : nullptr;
}

TEST(Subprocess, CapturesStdoutAndStderrAndTheExitCode) {
  auto child = shell("echo one; echo two; echo oops >&2; printf tail; exit 3");
  ASSERT_TRUE(child);
  LineReader out(child->stdoutFd());
  LineReader err(child->stderrFd());
  EXPECT_EQ(out.next(5s), "one");
  EXPECT_EQ(out.next(5s), "two");
  EXPECT_EQ(out.next(5s), "tail");
  EXPECT_EQ(out.next(5s), std::nullopt);
  EXPECT_TRUE(out.eof());
  EXPECT_EQ(err.next(5s), "oops");
  EXPECT_EQ(child->wait(5s), 3);
  EXPECT_FALSE(child->signal(SIGTERM));  // reaped
}

TEST(Subprocess, SignalsAreReportedAs128PlusTheSignal) {
  auto child = shell("echo up; exec sleep 30");
  ASSERT_TRUE(child);
  LineReader out(child->stdoutFd());
  EXPECT_EQ(out.next(5s), "up");
  EXPECT_EQ(child->poll(), std::nullopt);
  EXPECT_TRUE(child->signal(SIGTERM));
  EXPECT_EQ(child->wait(5s), 128 + SIGTERM);
}

TEST(Subprocess, EnvironmentIsAddedAndOverridden) {
  auto child = shell("echo \"$PD_TEST_A-$HOME\"", {{"PD_TEST_A", "x"}, {"HOME", "/nowhere"}});
  ASSERT_TRUE(child);
  LineReader out(child->stdoutFd());
  EXPECT_EQ(out.next(5s), "x-/nowhere");
  EXPECT_EQ(child->wait(5s), 0);
}

TEST(Subprocess, AMissingExecutableExitsWith127) {
  auto child = Subprocess::spawn({{"/nonexistent/pdserve"}});
  ASSERT_TRUE(child.ok());
  EXPECT_EQ((*child)->wait(5s), 127);
}

TEST(Subprocess, DestructionKillsAChildStillRunning) {
  pid_t pid = 0;
  {
    auto child = shell("exec sleep 30");
    ASSERT_TRUE(child);
    pid = child->pid();
  }
  EXPECT_NE(::kill(pid, 0), 0);  // gone and reaped
}

TEST(Subprocess, DrainHandsOverCompleteLines) {
  auto child = shell("echo a; echo b");
  ASSERT_TRUE(child);
  ASSERT_EQ(child->wait(5s), 0);
  LineReader out(child->stdoutFd());
  std::vector<std::string> lines;
  while (out.drain([&](const std::string& l) { lines.push_back(l); })) {
  }
  EXPECT_EQ(lines, (std::vector<std::string>{"a", "b"}));
}

}  // namespace
}  // namespace pd::proc
