#pragma once
/// An Asio io_context and the N threads that run it: the router's one event loop, shared by its
/// HTTP server (http::Server with ServerOptions::io) and its clients to the workers
/// (http::AsyncClient), so that a request costs no thread of its own.
///
/// Lifetime: shared (http::Server's sessions and the router's backend each hold it, and a socket
/// must not outlive its io_context). Its owner (whoever created it) calls stop() once every user
/// is done; the threads are joined there, not in a destructor that an io thread could run.
///
/// Thread rules: executor() and threadCount() are thread-safe. stop() is idempotent and must not
/// be called from one of the io threads. Handlers must not block.

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/result.h"

namespace pd::http {

class IoThreads {
 public:
  /// Starts `threads` threads (>= 1; InvalidArgument otherwise) named `name` in the log.
  [[nodiscard]] static Result<std::shared_ptr<IoThreads>> start(int threads, std::string name);

  IoThreads(const IoThreads&) = delete;
  IoThreads& operator=(const IoThreads&) = delete;
  IoThreads(IoThreads&&) = delete;
  IoThreads& operator=(IoThreads&&) = delete;
  /// stop() if it was not called (PD_CHECK: not on an io thread).
  ~IoThreads();

  [[nodiscard]] boost::asio::any_io_executor executor();
  [[nodiscard]] boost::asio::io_context& context() { return ioc_; }
  [[nodiscard]] int threadCount() const { return static_cast<int>(threads_.size()); }
  /// True on one of this object's io threads.
  [[nodiscard]] bool onIoThread() const;
  /// Lets the threads run until no work is left (at most a few seconds; then the loop is stopped
  /// and what is still queued is dropped) and joins them. Call it once the work that matters is
  /// over (the server stopped, generations ended). Blocks.
  void stop();

 private:
  IoThreads(int threads, std::string name);

  boost::asio::io_context ioc_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  const std::string name_;
  std::mutex stop_mu_;
  std::vector<std::thread> threads_;  // last: started after everything they read
};

}  // namespace pd::http
