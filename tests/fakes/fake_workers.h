#pragma once
/// Fake prefill and decode workers for router tests: real pd::http::Server instances in the test
/// process that serve the workers' internal API (docs/internal-api.md) with scripted behaviour.
///
/// A fake decode worker answers DecodeOpen with the descriptor "fake-kv:<port>:<request id>",
/// waits for the KV record of that descriptor (delivered by a fake prefill worker that knows it,
/// or a failure record), then streams the scripted token events and a finish. It counts failure
/// records against DecodeOpen.prefill_attempts as the real one does. A fake prefill worker
/// answers PrefillSubmit per its script: deliver the KV record and answer 200, refuse with 503
/// Overloaded, fail with a failure record and 502 PeerFailed, or hang until cancelled.
///
/// Everything each fake saw is recorded (opens, submissions, aborts, cancels, clients gone) so
/// tests can assert what reached the workers.
///
/// Thread rules: thread-safe. Handlers never block an io thread: waiting work runs on the fake's
/// own threads, joined by the destructor (which first stops the HTTP server).

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/check.h"
#include "pd/common/http_server.h"
#include "pd/common/worker_api.h"

namespace pd::fakes {

inline constexpr const char* kFakeModelHash = "00000000000000ab";

inline http::Response workerError(ErrorCode code, std::string message) {
  return http::Response::withBody(worker_api::httpStatusFor(code), "application/json",
                                  worker_api::errorJson(makeError(code, std::move(message))));
}

inline http::Response workerJson(std::string body) {
  return http::Response::withBody(200, "application/json", std::move(body));
}

/// The part both fakes share: the HTTP server, the status endpoint, and helper threads.
class FakeWorkerBase {
 public:
  FakeWorkerBase(const FakeWorkerBase&) = delete;
  FakeWorkerBase& operator=(const FakeWorkerBase&) = delete;
  FakeWorkerBase(FakeWorkerBase&&) = delete;
  FakeWorkerBase& operator=(FakeWorkerBase&&) = delete;

  [[nodiscard]] std::uint16_t port() const { return server_->port(); }
  [[nodiscard]] std::string address() const { return "127.0.0.1:" + std::to_string(port()); }

  void setStatus(const worker_api::WorkerStatus& status) {
    std::lock_guard lock(mu_);
    status_ = status;
  }
  [[nodiscard]] worker_api::WorkerStatus status() const {
    std::lock_guard lock(mu_);
    return status_;
  }
  /// While set, GET /v1/internal/status answers 500 (a failing poll).
  void setStatusFails(bool fails) {
    std::lock_guard lock(mu_);
    status_fails_ = fails;
  }
  [[nodiscard]] int statusPolls() const {
    std::lock_guard lock(mu_);
    return status_polls_;
  }

 protected:
  explicit FakeWorkerBase(std::string role) {
    status_.role = std::move(role);
    status_.ready = true;
    status_.model_hash = kFakeModelHash;
    status_.free_blocks = 100;
    status_.total_blocks = 128;
    status_.block_size = 16;
  }
  ~FakeWorkerBase() = default;

  /// Starts the server; call from the derived constructor once its state is built.
  void serve(std::vector<http::Route> routes) {
    routes.push_back({"GET", std::string(worker_api::kStatusPath), [this](http::Request, http::Exchange ex) {
                        std::lock_guard lock(mu_);
                        ++status_polls_;
                        if (status_fails_) {
                          ex.respond(workerError(ErrorCode::Internal, "status unavailable"));
                        } else {
                          ex.respond(workerJson(worker_api::toJson(status_)));
                        }
                      }});
    auto server = http::Server::start(http::ServerOptions{}, std::move(routes));
    PD_CHECK_MSG(server.ok(), "fake worker server did not start");
    server_ = std::move(server).value();
  }

  /// Stops the server and joins helper threads; call first thing in the derived destructor.
  void shutdown() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (server_) server_->stop();
    std::vector<std::thread> threads;
    {
      std::lock_guard lock(mu_);
      threads.swap(threads_);
    }
    for (auto& t : threads) t.join();
  }

  void spawn(std::function<void()> work) {
    std::lock_guard lock(mu_);
    threads_.emplace_back(std::move(work));
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // guarded by mu_
  worker_api::WorkerStatus status_;

 private:
  bool status_fails_ = false;
  int status_polls_ = 0;
  std::vector<std::thread> threads_;
  std::unique_ptr<http::Server> server_;
};

/// How a fake decode worker serves the next requests.
struct DecodeScript {
  /// Answer DecodeOpen with this error instead of a stream (e.g. Overloaded -> 503).
  std::optional<ErrorCode> refuse;
  std::string refuse_message = "refused by script";
  /// Token events after the KV record arrived (the first is prefill's token).
  std::vector<std::vector<pd::TokenId>> tokens{{100}, {101}};
  pd::FinishReason finish_reason = pd::FinishReason::Length;
  std::chrono::milliseconds token_delay{0};
  /// Cut the connection after this many token events (no finish).
  std::optional<std::size_t> cut_after;
  /// End the stream with a `preempted` event after this many token events (the pool ran dry).
  std::optional<std::size_t> preempt_after;
  /// After this many token events, send nothing more until aborted (a stuck worker).
  std::optional<std::size_t> hang_after;
  /// After this many token events, wait until resume() (or an abort), then go on with the rest.
  std::optional<std::size_t> pause_after;
  /// Send an error event with this code right after the descriptor.
  std::optional<ErrorCode> error_after_descriptor;
};

class FakeDecodeWorker final : public FakeWorkerBase {
 public:
  FakeDecodeWorker() : FakeWorkerBase("decode") {
    serve({{"POST", std::string(worker_api::kDecodeOpenPath),
            [this](http::Request r, http::Exchange ex) { open(std::move(r), std::move(ex)); }},
           {"POST", std::string(worker_api::kDecodeAbortPath), [this](http::Request r, http::Exchange ex) {
              auto a = worker_api::parseAbortRequest(r.body);
              if (!a.ok()) return (void)ex.respond(workerError(ErrorCode::InvalidArgument, "bad abort"));
              bool found = false;
              {
                std::lock_guard lock(mu_);
                aborts_.push_back(a.value().request_id);
                if (auto it = live_.find(a.value().request_id); it != live_.end()) {
                  it->second->aborted = true;
                  found = true;
                }
              }
              cv_.notify_all();
              ex.respond(workerJson(found ? R"({"found":true})" : R"({"found":false})"));
            }}});
  }
  ~FakeDecodeWorker() { shutdown(); }

  void setScript(DecodeScript script) {
    std::lock_guard lock(mu_);
    script_ = std::move(script);
  }
  /// Attached choices (DecodeOpen::attach_to) are refused with `code` (as a worker whose parent
  /// stream is gone would: NotFound); nullopt (the default): they attach to their parent's stream
  /// and play the script once its KV arrived.
  void refuseAttach(std::optional<ErrorCode> code) {
    std::lock_guard lock(mu_);
    refuse_attach_ = code;
  }
  /// Refuse opens of more than one choice with 400 Unsupported, as a tensor-parallel decode
  /// worker does (it cannot share one prompt among choices).
  void refuseChoices(bool refuse) {
    std::lock_guard lock(mu_);
    refuse_choices_ = refuse;
  }
  /// Lets every stream paused by DecodeScript::pause_after (now or later) go on.
  void resume() {
    std::lock_guard lock(mu_);
    resumed_ = true;
    cv_.notify_all();
  }
  /// Streams waiting at their pause_after point.
  [[nodiscard]] std::size_t paused() const {
    std::lock_guard lock(mu_);
    return paused_;
  }

  /// A prefill worker's KV record (or failure record) for `descriptor`; false if it is not ours.
  /// Whether `descriptor` is one of this worker's live requests'.
  [[nodiscard]] bool holdsDescriptor(const std::string& descriptor) const {
    std::lock_guard lock(mu_);
    for (const auto& entry : live_) {
      if (entry.second->descriptor == descriptor) return true;
    }
    return false;
  }

  bool deliverKv(const std::string& descriptor, bool success) {
    std::lock_guard lock(mu_);
    for (auto& [id, req] : live_) {
      if (req->descriptor != descriptor) continue;
      if (success) {
        req->kv_arrived = true;
      } else {
        ++req->failures;
      }
      cv_.notify_all();
      return true;
    }
    return false;
  }

  [[nodiscard]] std::vector<worker_api::DecodeOpen> opens() const {
    std::lock_guard lock(mu_);
    return opens_;
  }
  [[nodiscard]] std::vector<std::string> aborts() const {
    std::lock_guard lock(mu_);
    return aborts_;
  }
  /// Requests whose client closed the stream before it ended.
  [[nodiscard]] std::vector<std::string> gone() const {
    std::lock_guard lock(mu_);
    return gone_;
  }
  /// Requests still held (blocks not freed).
  [[nodiscard]] std::size_t live() const {
    std::lock_guard lock(mu_);
    return live_.size();
  }

 private:
  struct Live {
    std::string descriptor;        // empty for an attached choice
    std::shared_ptr<Live> parent;  // an attached choice's: its KV is the parent's
    bool kv_arrived = false;
    std::int64_t failures = 0;
    bool aborted = false;
    bool client_gone = false;
  };

  void open(http::Request r, http::Exchange ex) {
    auto parsed = worker_api::parseDecodeOpen(r.body);
    if (!parsed.ok()) return (void)ex.respond(workerError(ErrorCode::InvalidArgument, parsed.error().message));
    const worker_api::DecodeOpen req = parsed.value();
    DecodeScript script;
    auto live = std::make_shared<Live>();
    {
      std::lock_guard lock(mu_);
      opens_.push_back(req);
      script = script_;
      if (refuse_choices_ && req.choices > 1) {
        return (void)ex.respond(workerError(ErrorCode::Unsupported, "n > 1 is not supported with tensor parallelism"));
      }
      if (!req.attach_to.empty() && !script.refuse) {
        const auto parent = live_.find(req.attach_to);
        if (refuse_attach_ || parent == live_.end()) {
          return (void)ex.respond(workerError(refuse_attach_.value_or(ErrorCode::NotFound), "cannot attach"));
        }
        live->parent = parent->second;
        live_[req.request_id] = live;
      } else if (!script.refuse) {
        if (live_.count(req.request_id) != 0) {
          return (void)ex.respond(workerError(ErrorCode::InvalidArgument, "duplicate request id"));
        }
        live->descriptor = "fake-kv:" + std::to_string(port()) + ":" + req.request_id;
        // A local prefill (conditional disaggregation) needs no KV from anyone.
        live->kv_arrived = !req.local_prompt_token_ids.empty();
        live_[req.request_id] = live;
      }
    }
    if (script.refuse) return (void)ex.respond(workerError(*script.refuse, script.refuse_message));
    ex.onClientGone([this, live] {
      std::lock_guard lock(mu_);
      live->client_gone = true;
      cv_.notify_all();
    });
    ex.beginStream(200, {{"Content-Type", "application/x-ndjson"}});
    worker_api::DecodeEvent d;
    d.type = worker_api::DecodeEventType::Descriptor;
    if (req.local_prompt_token_ids.empty()) d.kv_descriptor = live->descriptor;
    d.blocks = 1;
    ex.write(worker_api::toJson(d) + "\n");
    spawn([this, req, script, live, ex]() mutable { stream(req, script, *live, std::move(ex)); });
  }

  // On a helper thread: wait for the KV, then play the script.
  void stream(const worker_api::DecodeOpen& req, const DecodeScript& script, Live& live, http::Exchange ex) {
    const auto end_with = [&](std::optional<worker_api::DecodeEvent> last) {
      {
        std::lock_guard lock(mu_);
        live_.erase(req.request_id);
        if (live.client_gone) gone_.push_back(req.request_id);
      }
      if (last) {
        ex.write(worker_api::toJson(*last) + "\n");
        ex.end();
      }
      // Without a last event the exchange is dropped unanswered: the server cuts the stream.
    };
    const auto error_event = [](ErrorCode code, std::string message) {
      worker_api::DecodeEvent e;
      e.type = worker_api::DecodeEventType::Error;
      e.code = code;
      e.message = std::move(message);
      return e;
    };
    if (script.error_after_descriptor) return end_with(error_event(*script.error_after_descriptor, "scripted"));
    {
      std::unique_lock lock(mu_);
      const Live& kv = live.parent ? *live.parent : live;  // an attached choice's KV is its parent's
      const bool woke = cv_.wait_for(lock, std::chrono::milliseconds(req.kv_timeout_ms), [&] {
        return stopping_ || kv.kv_arrived || live.aborted || live.client_gone || kv.failures >= req.prefill_attempts;
      });
      if (!woke || !kv.kv_arrived) {
        const bool timed_out = !woke;
        const bool failed = kv.failures >= req.prefill_attempts;
        lock.unlock();
        if (timed_out) return end_with(error_event(ErrorCode::Timeout, "kv did not arrive"));
        if (failed) return end_with(error_event(ErrorCode::PeerFailed, "every prefill attempt failed"));
        return end_with(error_event(ErrorCode::Cancelled, "aborted"));
      }
    }
    std::size_t sent = 0;
    std::int64_t tokens = 0;
    const auto preempted_event = [&tokens] {
      worker_api::DecodeEvent e;
      e.type = worker_api::DecodeEventType::Preempted;
      e.message = "scripted preemption";
      e.completion_tokens = tokens;
      return e;
    };
    for (const auto& batch : script.tokens) {
      if (script.cut_after && sent == *script.cut_after) return end_with(std::nullopt);
      if (script.preempt_after && sent == *script.preempt_after) return end_with(preempted_event());
      if (script.hang_after && sent == *script.hang_after) {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || live.aborted || live.client_gone; });
        lock.unlock();
        return end_with(error_event(ErrorCode::Cancelled, "aborted"));
      }
      if (script.pause_after && sent == *script.pause_after) {
        std::unique_lock lock(mu_);
        ++paused_;
        cv_.notify_all();
        cv_.wait(lock, [&] { return stopping_ || resumed_ || live.aborted || live.client_gone; });
        --paused_;
        if (!resumed_) {
          lock.unlock();
          return end_with(error_event(ErrorCode::Cancelled, "aborted"));
        }
      }
      {
        std::unique_lock lock(mu_);
        if (cv_.wait_for(lock, script.token_delay, [&] { return stopping_ || live.aborted || live.client_gone; })) {
          lock.unlock();
          return end_with(error_event(ErrorCode::Cancelled, "aborted"));
        }
      }
      worker_api::DecodeEvent t;
      t.type = worker_api::DecodeEventType::Tokens;
      t.token_ids = batch;
      for (const auto id : batch) t.logprobs.push_back({id, -0.5F, {{id, -0.5F}}});
      if (!req.logprobs) t.logprobs.clear();
      ex.write(worker_api::toJson(t) + "\n");
      ++sent;
      tokens += static_cast<std::int64_t>(batch.size());
    }
    if (script.cut_after && sent == *script.cut_after) return end_with(std::nullopt);
    worker_api::DecodeEvent f;
    f.type = worker_api::DecodeEventType::Finish;
    f.finish_reason = script.finish_reason;
    f.prompt_tokens = req.prompt_tokens;
    f.completion_tokens = tokens;
    end_with(f);
  }

  DecodeScript script_;
  std::optional<ErrorCode> refuse_attach_;  // guarded by mu_
  bool refuse_choices_ = false;             // guarded by mu_
  bool resumed_ = false;                    // guarded by mu_
  std::size_t paused_ = 0;                  // guarded by mu_
  std::map<std::string, std::shared_ptr<Live>> live_;
  std::vector<worker_api::DecodeOpen> opens_;
  std::vector<std::string> aborts_;
  std::vector<std::string> gone_;
};

enum class PrefillBehaviour {
  Ok,          ///< deliver the KV record, answer 200
  Overloaded,  ///< answer 503 Overloaded without touching the decode worker
  Fail,        ///< send a failure record, answer 502 PeerFailed
  Hang,        ///< never answer until cancelled (then 409 Cancelled and a failure record)
};

class FakePrefillWorker final : public FakeWorkerBase {
 public:
  /// `decoders` receive the KV records; it must outlive this worker.
  explicit FakePrefillWorker(const std::vector<FakeDecodeWorker*>& decoders)
      : FakeWorkerBase("prefill"), decoders_(decoders) {
    serve({{"POST", std::string(worker_api::kPrefillPath),
            [this](http::Request r, http::Exchange ex) { submit(std::move(r), std::move(ex)); }},
           {"POST", std::string(worker_api::kPrefillCancelPath),
            [this](http::Request r, http::Exchange ex) {
              auto a = worker_api::parseAbortRequest(r.body);
              if (!a.ok()) return (void)ex.respond(workerError(ErrorCode::InvalidArgument, "bad cancel"));
              std::optional<Hung> hung;
              {
                std::lock_guard lock(mu_);
                cancels_.push_back(a.value().request_id);
                if (auto it = hung_.find(a.value().request_id); it != hung_.end()) {
                  hung = std::move(it->second);
                  hung_.erase(it);
                }
              }
              if (hung) {
                deliver(hung->descriptor, false);
                hung->exchange.respond(workerError(ErrorCode::Cancelled, "cancelled"));
              }
              ex.respond(workerJson(hung ? R"({"found":true})" : R"({"found":false})"));
            }},
           {"GET", std::string(worker_api::kKvEventsPath), [this](http::Request r, http::Exchange ex) {
              std::function<std::string(const http::Request&)> answer;
              {
                std::lock_guard lock(mu_);
                answer = kv_events_;
                kv_event_queries_.push_back(r.query);
              }
              if (!answer) return (void)ex.respond(workerError(ErrorCode::NotFound, "no kv events"));
              ex.respond(workerJson(answer(r)));
            }}});
  }

  /// What GET /v1/internal/kv_events answers (200 with the returned body); unset: 404.
  void setKvEvents(std::function<std::string(const http::Request&)> answer) {
    std::lock_guard lock(mu_);
    kv_events_ = std::move(answer);
  }
  /// The query strings of the kv_events reads so far.
  [[nodiscard]] std::vector<std::string> kvEventQueries() const {
    std::lock_guard lock(mu_);
    return kv_event_queries_;
  }
  ~FakePrefillWorker() {
    shutdown();
    std::lock_guard lock(mu_);
    hung_.clear();
  }

  void setBehaviour(PrefillBehaviour behaviour) {
    std::lock_guard lock(mu_);
    behaviour_ = behaviour;
  }
  /// KV for `decoder` cannot reach it (a cut link): nothing arrives there, not even a failure
  /// record, and the submit is answered 504 Timeout, as a real worker's transfer deadline does.
  void addUnreachable(const FakeDecodeWorker* decoder) {
    std::lock_guard lock(mu_);
    unreachable_.push_back(decoder);
  }
  [[nodiscard]] std::vector<worker_api::PrefillSubmit> submits() const {
    std::lock_guard lock(mu_);
    return submits_;
  }
  [[nodiscard]] std::vector<std::string> cancels() const {
    std::lock_guard lock(mu_);
    return cancels_;
  }
  /// Hung submissions whose client closed the connection.
  [[nodiscard]] std::vector<std::string> gone() const {
    std::lock_guard lock(mu_);
    return gone_;
  }

 private:
  struct Hung {
    std::string descriptor;
    http::Exchange exchange;
  };

  void deliver(const std::string& descriptor, bool success) {
    for (auto* d : decoders_) {
      if (d->deliverKv(descriptor, success)) return;
    }
  }

  void submit(http::Request r, http::Exchange ex) {
    auto parsed = worker_api::parsePrefillSubmit(r.body);
    if (!parsed.ok()) return (void)ex.respond(workerError(ErrorCode::InvalidArgument, parsed.error().message));
    const auto req = parsed.value();
    PrefillBehaviour behaviour{};
    std::vector<const FakeDecodeWorker*> unreachable;
    {
      std::lock_guard lock(mu_);
      submits_.push_back(req);
      behaviour = behaviour_;
      unreachable = unreachable_;
    }
    if (std::any_of(unreachable.begin(), unreachable.end(),
                    [&](const FakeDecodeWorker* d) { return d->holdsDescriptor(req.kv_descriptor); })) {
      ex.respond(workerError(ErrorCode::Timeout, "the KV transfer timed out"));
      return;
    }
    switch (behaviour) {
      case PrefillBehaviour::Ok: {
        deliver(req.kv_descriptor, true);
        worker_api::PrefillOutcome o;
        o.first_token = 100;
        o.prompt_tokens = static_cast<std::int64_t>(req.token_ids.size());
        ex.respond(workerJson(worker_api::toJson(o)));
        return;
      }
      case PrefillBehaviour::Overloaded:
        ex.respond(workerError(ErrorCode::Overloaded, "queue full"));
        return;
      case PrefillBehaviour::Fail:
        deliver(req.kv_descriptor, false);
        ex.respond(workerError(ErrorCode::PeerFailed, "transfer failed"));
        return;
      case PrefillBehaviour::Hang: {
        const std::string id = req.request_id;
        ex.onClientGone([this, id] {
          std::optional<Hung> hung;
          {
            std::lock_guard lock(mu_);
            gone_.push_back(id);
            if (auto it = hung_.find(id); it != hung_.end()) {
              hung = std::move(it->second);
              hung_.erase(it);
            }
          }
          if (hung) deliver(hung->descriptor, false);
        });
        std::lock_guard lock(mu_);
        hung_.emplace(id, Hung{req.kv_descriptor, ex});
        return;
      }
    }
  }

  std::vector<FakeDecodeWorker*> decoders_;
  PrefillBehaviour behaviour_ = PrefillBehaviour::Ok;
  std::vector<const FakeDecodeWorker*> unreachable_;            // guarded by mu_
  std::function<std::string(const http::Request&)> kv_events_;  // guarded by mu_
  std::vector<std::string> kv_event_queries_;                   // guarded by mu_
  std::vector<worker_api::PrefillSubmit> submits_;
  std::vector<std::string> cancels_;
  std::vector<std::string> gone_;
  std::map<std::string, Hung> hung_;
};

}  // namespace pd::fakes
