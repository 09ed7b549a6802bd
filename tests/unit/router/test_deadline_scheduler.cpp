// Tests router/src/deadline_scheduler.h: callbacks at deadlines, cancel, and close() before the
// io_context is destroyed while another holder still calls the scheduler (the teardown order of
// ApiServer, where a backend thread may finish a request after the server stopped).
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "deadline_scheduler.h"
#include "pd/common/check.h"
#include "pd/common/io_threads.h"

namespace {

using pd::router::DeadlineScheduler;
using namespace std::chrono_literals;

/// The router's io threads (one), as ApiServer starts its own.
std::shared_ptr<pd::http::IoThreads> startIo() {
  auto io = pd::http::IoThreads::start(1, "test-deadlines");
  PD_CHECK(io.ok());
  return std::move(io).value();
}

TEST(DeadlineScheduler, RunsAPassedDeadline) {
  auto io = startIo();
  DeadlineScheduler scheduler(io->executor());
  std::promise<void> ran;
  const auto id = scheduler.schedule(DeadlineScheduler::Clock::now(), [&ran] { ran.set_value(); });
  EXPECT_NE(id, 0U);
  EXPECT_EQ(ran.get_future().wait_for(30s), std::future_status::ready);
}

TEST(DeadlineScheduler, CancelledCallbackNeverRuns) {
  auto io = startIo();
  DeadlineScheduler scheduler(io->executor());
  bool cancelled_ran = false;
  const auto cancelled = scheduler.schedule(DeadlineScheduler::Clock::now() + 50ms, [&] { cancelled_ran = true; });
  scheduler.cancel(cancelled);
  EXPECT_EQ(scheduler.pending(), 0U);
  // A later deadline on the same io thread runs after the cancelled one would have.
  std::promise<void> later;
  scheduler.schedule(DeadlineScheduler::Clock::now() + 100ms, [&later] { later.set_value(); });
  ASSERT_EQ(later.get_future().wait_for(30s), std::future_status::ready);
  io->stop();
  EXPECT_FALSE(cancelled_ran);
}

TEST(DeadlineScheduler, ClosedSchedulerOutlivesItsIoContext) {
  auto io = startIo();
  auto scheduler = std::make_shared<DeadlineScheduler>(io->executor());
  std::vector<DeadlineScheduler::Id> ids;
  bool ran = false;
  for (int i = 0; i < 64; ++i)
    ids.push_back(scheduler->schedule(DeadlineScheduler::Clock::now() + 1h, [&ran] { ran = true; }));
  scheduler->close();
  EXPECT_EQ(scheduler->pending(), 0U);
  EXPECT_EQ(scheduler->schedule(DeadlineScheduler::Clock::now(), [&ran] { ran = true; }), 0U);
  io->stop();
  io.reset();  // the io_context and its timer service are gone
  // A request finishing late still holds the scheduler and cancels its deadline: no timer is touched
  // (AddressSanitizer reported a use after free here before close() existed).
  std::thread late([scheduler, ids] {
    for (auto id : ids) scheduler->cancel(id);
  });
  late.join();
  scheduler.reset();
  EXPECT_FALSE(ran);
}

}  // namespace
