#include "pd/common/io_threads.h"

#include <algorithm>
#include <chrono>
#include <exception>

#include "pd/common/check.h"
#include "pd/common/log.h"

namespace pd::http {

namespace net = boost::asio;

namespace {
constexpr std::chrono::seconds kStopGrace{5};
}  // namespace

Result<std::shared_ptr<IoThreads>> IoThreads::start(int threads, std::string name) {
  if (threads < 1) return makeError(ErrorCode::InvalidArgument, "io_threads must be at least 1");
  return std::shared_ptr<IoThreads>(new IoThreads(threads, std::move(name)));
}

IoThreads::IoThreads(int threads, std::string name)
    : ioc_(threads), work_(net::make_work_guard(ioc_)), name_(std::move(name)) {
  threads_.reserve(static_cast<std::size_t>(threads));
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] {
      for (;;) {
        try {
          ioc_.run();
          return;
        } catch (const std::exception& e) {
          log::error(name_, "io thread: unexpected exception: {}", e.what());
        }
      }
    });
  }
}

IoThreads::~IoThreads() {
  stop();
}

net::any_io_executor IoThreads::executor() {
  return ioc_.get_executor();
}

bool IoThreads::onIoThread() const {
  const auto self = std::this_thread::get_id();
  return std::any_of(threads_.begin(), threads_.end(), [self](const std::thread& t) { return t.get_id() == self; });
}

void IoThreads::stop() {
  std::lock_guard lock(stop_mu_);
  PD_CHECK_MSG(!onIoThread(), "IoThreads stopped from one of its own threads");
  work_.reset();
  // Let the threads finish what is queued (closing sockets, cancelled operations) and return
  // once the loop runs out of work; something that never ends (a listener nobody stopped) is
  // cut after kStopGrace rather than hanging the process.
  const auto until = std::chrono::steady_clock::now() + kStopGrace;
  while (!ioc_.stopped() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ioc_.stop();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

}  // namespace pd::http
