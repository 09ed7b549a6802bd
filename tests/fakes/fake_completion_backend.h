#pragma once
/// A scripted CompletionBackend for router tests. Each started generation plays a Script: its
/// deltas one by one (with a delay between them), then a finish or an error, on the fake's own
/// worker thread, exactly as a real backend would call the sink (serially, from another thread).
/// It records every request it was given and every abort, so tests can assert that a client's
/// disconnect reached the backend and that nothing stays running.
///
/// Thread rules: thread-safe. The destructor ends every generation still running (onError
/// Cancelled) and joins the worker thread.

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pd/router/completion_backend.h"

namespace pd::fakes {

struct Script {
  std::vector<router::TokenDelta> deltas;
  router::FinishEvent end;
  std::optional<Error> error;        ///< ends with this error after the deltas, instead of finishing
  std::optional<Error> start_error;  ///< start() itself fails with this
  bool hang = false;                 ///< after the deltas, wait until aborted (a stuck worker)
  std::chrono::milliseconds delay{0};

  /// One token per piece, ids 1000, 1001, ...; finishes with `reason`.
  static Script fromPieces(const std::vector<std::string>& pieces, pd::FinishReason reason = pd::FinishReason::Stop) {
    Script s;
    pd::TokenId id = 1000;
    for (const auto& p : pieces) s.deltas.push_back(router::TokenDelta{{id++}, p, {}});
    s.end.end.reason = reason;
    return s;
  }
};

class FakeCompletionBackend final : public router::CompletionBackend {
 public:
  FakeCompletionBackend() : worker_([this] { run(); }) {}
  FakeCompletionBackend(const FakeCompletionBackend&) = delete;
  FakeCompletionBackend& operator=(const FakeCompletionBackend&) = delete;
  FakeCompletionBackend(FakeCompletionBackend&&) = delete;
  FakeCompletionBackend& operator=(FakeCompletionBackend&&) = delete;
  ~FakeCompletionBackend() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      for (auto& [id, g] : generations_) {
        g->aborted = true;
        queue_.emplace(Clock::now(), id);
      }
    }
    cv_.notify_all();
    worker_.join();
  }

  /// The script every later start() plays.
  void setScript(Script script) {
    std::lock_guard lock(mu_);
    script_for_ = [script](const router::GenerationRequest&) { return script; };
  }
  /// A script chosen per request.
  void setScriptFactory(std::function<Script(const router::GenerationRequest&)> factory) {
    std::lock_guard lock(mu_);
    script_for_ = std::move(factory);
  }
  void setReady(bool ready) {
    std::lock_guard lock(mu_);
    ready_ = ready;
  }

  [[nodiscard]] Result<std::unique_ptr<router::GenerationControl>> start(
      router::GenerationRequest request, std::shared_ptr<router::TokenSink> sink) override {
    std::lock_guard lock(mu_);
    Script script = script_for_ ? script_for_(request) : Script{};
    requests_.push_back(request);
    if (script.start_error) return *script.start_error;
    const std::uint64_t id = next_id_++;
    auto g = std::make_shared<Generation>();
    g->sink = std::move(sink);
    g->script = std::move(script);
    generations_.emplace(id, g);
    queue_.emplace(Clock::now(), id);
    cv_.notify_all();
    return std::unique_ptr<router::GenerationControl>(new Control(this, id));
  }

  [[nodiscard]] bool ready() const override {
    std::lock_guard lock(mu_);
    return ready_;
  }

  [[nodiscard]] std::vector<router::GenerationRequest> requests() const {
    std::lock_guard lock(mu_);
    return requests_;
  }
  [[nodiscard]] int aborts() const {
    std::lock_guard lock(mu_);
    return aborts_;
  }
  [[nodiscard]] std::size_t active() const {
    std::lock_guard lock(mu_);
    return generations_.size();
  }
  /// Waits until no generation is running.
  bool waitIdle(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    return idle_cv_.wait_for(lock, timeout, [&] { return generations_.empty(); });
  }

 private:
  using Clock = std::chrono::steady_clock;

  struct Generation {
    std::shared_ptr<router::TokenSink> sink;
    Script script;
    std::size_t next = 0;
    bool aborted = false;
  };

  class Control final : public router::GenerationControl {
   public:
    Control(FakeCompletionBackend* backend, std::uint64_t id) : backend_(backend), id_(id) {}
    void abort() override { backend_->abort(id_); }

   private:
    FakeCompletionBackend* backend_;
    std::uint64_t id_;
  };

  void abort(std::uint64_t id) {
    std::lock_guard lock(mu_);
    ++aborts_;
    const auto it = generations_.find(id);
    if (it == generations_.end() || it->second->aborted) return;
    it->second->aborted = true;
    queue_.emplace(Clock::now(), id);
    cv_.notify_all();
  }

  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      if (queue_.empty()) {
        if (stopping_ && generations_.empty()) return;
        cv_.wait(lock);
        continue;
      }
      const auto next = queue_.begin();
      const Clock::time_point due = next->first;  // a copy: the entry may go while we wait
      if (Clock::now() < due) {
        cv_.wait_until(lock, due);
        continue;
      }
      const std::uint64_t id = next->second;
      queue_.erase(next);
      const auto it = generations_.find(id);
      if (it == generations_.end()) continue;
      auto g = it->second;
      // Decide under the lock, call the sink without it (the sink may call abort()).
      enum class Action { Token, Finish, Fail, Cancel, Park } action = Action::Park;
      if (g->aborted) {
        action = Action::Cancel;
      } else if (g->next < g->script.deltas.size()) {
        action = Action::Token;
      } else if (g->script.hang) {
        action = Action::Park;
      } else {
        action = g->script.error ? Action::Fail : Action::Finish;
      }
      if (action == Action::Park) continue;
      if (action != Action::Token) generations_.erase(it);
      router::TokenDelta delta;
      if (action == Action::Token) {
        delta = g->script.deltas[g->next++];
        queue_.emplace(Clock::now() + g->script.delay, id);
      }
      lock.unlock();
      switch (action) {
        case Action::Token:
          g->sink->onTokens(std::move(delta));
          break;
        case Action::Finish:
          g->sink->onFinish(g->script.end);
          break;
        case Action::Fail:
          g->sink->onError(*g->script.error);
          break;
        case Action::Cancel:
          g->sink->onError(makeError(ErrorCode::Cancelled, "aborted"));
          break;
        case Action::Park:
          break;
      }
      g.reset();
      lock.lock();
      idle_cv_.notify_all();
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::function<Script(const router::GenerationRequest&)> script_for_;
  bool ready_ = true;
  bool stopping_ = false;
  int aborts_ = 0;
  std::uint64_t next_id_ = 1;
  std::vector<router::GenerationRequest> requests_;
  std::map<std::uint64_t, std::shared_ptr<Generation>> generations_;
  std::multimap<Clock::time_point, std::uint64_t> queue_;
  std::thread worker_;  // last: starts after everything it uses
};

}  // namespace pd::fakes
