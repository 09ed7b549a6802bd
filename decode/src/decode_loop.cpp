#include "pd/decode/decode_loop.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <utility>

#include "pd/common/log.h"
#include "pd/engine/tp_engine.h"

namespace pd::decode {

DecodeLoop::DecodeLoop(model::Engine& engine, KvPool& pool, DecodeEngineOptions options,
                       model::TpLeaderEngine* tp_leader)
    : tp_leader_(tp_leader),
      overlap_(options.overlap_steps),
      engine_(engine, pool, options),
      compute_thread_(overlap_ ? std::thread([this] { compute(); }) : std::thread()),
      thread_([this] { run(); }) {}

DecodeLoop::~DecodeLoop() {
  {
    std::lock_guard lock(inbox_->mutex);
    inbox_->closed = true;
  }
  inbox_->wake.notify_one();
  thread_.join();  // completes a running step first
  if (compute_thread_.joinable()) {
    {
      std::lock_guard lock(compute_mutex_);
      compute_stop_ = true;
    }
    compute_wake_.notify_one();
    compute_thread_.join();
  }
}

void DecodeLoop::compute() {
  for (;;) {
    {
      std::unique_lock lock(compute_mutex_);
      compute_wake_.wait(lock, [this] { return compute_requested_ || compute_stop_; });
      if (!compute_requested_) return;
      compute_requested_ = false;
    }
    engine_.computeStep();
    {
      std::lock_guard lock(inbox_->mutex);
      compute_done_ = true;
    }
    inbox_->wake.notify_one();
  }
}

bool DecodeLoop::Inbox::post(Command command) {
  {
    std::lock_guard lock(mutex);
    if (closed) return false;
    commands.push_back(std::move(command));
  }
  wake.notify_one();
  return true;
}

Result<std::vector<std::int32_t>> DecodeLoop::admit(DecodeRequest request) {
  // shared_ptr: std::function needs a copyable callable, and a promise is move-only.
  auto answer = std::make_shared<std::promise<Result<std::vector<std::int32_t>>>>();
  auto future = answer->get_future();
  auto req = std::make_shared<DecodeRequest>(std::move(request));
  post([answer, req](DecodeEngine& e) { answer->set_value(e.admit(std::move(*req))); });
  return future.get();
}

struct DecodeLoop::KvWait {
  std::shared_ptr<Inbox> inbox;
  kvtransfer::Transport* transport = nullptr;
  model::TpLeaderEngine* tp_leader = nullptr;  // set once the followers expect the KV too
  std::uint64_t id = 0;
  Clock::time_point deadline;
  std::mutex mutex;
  std::int64_t failures_to_absorb = 0;  // guarded by mutex
  bool stopped = false;                 // guarded by mutex: the request ended, never re-arm

  // The request ended while waiting: no more re-arming, and the pending expectation (if any)
  // is cancelled so that the transport drops its late bytes.
  void stop() {
    model::TpLeaderEngine* followers = nullptr;
    {
      std::lock_guard lock(mutex);
      stopped = true;
      followers = std::exchange(tp_leader, nullptr);
    }
    transport->cancelExpect(id);
    // Best effort: a broken group has nothing to cancel (its followers are gone or failing).
    if (followers != nullptr) (void)followers->cancelKv(id);
  }
  // The request ended while waiting and its blocks are quarantined (rma): the pending
  // expectation stays armed so that its outcome ends the quarantine, but it is not re-armed.
  void endAttempts() {
    std::lock_guard lock(mutex);
    stopped = true;
  }
};

kvtransfer::ArrivalFn DecodeLoop::waitArrival(std::shared_ptr<KvWait> wait) {
  return [wait = std::move(wait)](std::uint64_t request_id, Result<kvtransfer::CompletionRecord> record) {
    // Timeout is the deadline of every attempt together; any other failure may be one attempt's.
    // An unauthenticated record came from the descriptor's holder, whose prefill worker reported
    // success: no retry follows it, so it ends the request now.
    if (!record.ok() && record.error().code != ErrorCode::Timeout &&
        record.error().code != ErrorCode::Unauthenticated) {
      std::lock_guard lock(wait->mutex);
      if (!wait->stopped && wait->failures_to_absorb > 0) {
        // Re-armed here, on the transport's thread, so the next attempt's bytes are never dropped.
        const Status rearmed = wait->transport->expect(request_id, wait->deadline, waitArrival(wait));
        if (rearmed.ok()) {
          --wait->failures_to_absorb;
          auto failure = std::make_shared<Error>(std::move(record).error());
          wait->inbox->post([request_id, failure](DecodeEngine& e) { e.noteKvRetry(request_id, *failure); });
          return;
        }
        log::warn("decode", "request {}: cannot wait for another prefill attempt: {}", request_id,
                  rearmed.error().toString());
      }
    }
    model::TpLeaderEngine* followers = nullptr;
    {
      std::lock_guard lock(wait->mutex);
      followers = wait->tp_leader;
    }
    auto rec = std::make_shared<Result<kvtransfer::CompletionRecord>>(std::move(record));
    const Clock::time_point deadline = wait->deadline;
    wait->inbox->post([request_id, rec, followers, deadline](DecodeEngine& e) {
      if (followers != nullptr && rec->ok() && e.awaitingKv(request_id)) {
        // Every rank must hold the KV before a step reads it: a rank on the staging path copies
        // it into its pool when its own record arrives, which may be after ours (on the direct
        // path the sender flushed every rank's puts before any record; the check costs one
        // collective). A rank whose KV never lands fails the request here, not the group.
        // Bounded well below a KV deadline: every step waits with it.
        constexpr std::int64_t kMostMs = 10'000;
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
        const auto wait_ms = static_cast<std::uint32_t>(std::clamp<std::int64_t>(left, 1, kMostMs));
        if (Status s = followers->awaitKv(request_id, wait_ms); !s.ok()) *rec = std::move(s).error();
      }
      (void)e.onKvReady(request_id, std::move(*rec));
    });
  };
}

void DecodeLoop::openLocalAsync(DecodeRequest request, LocalDone done) {
  PD_CHECK(!request.local_prompt.empty());
  auto req = std::make_shared<DecodeRequest>(std::move(request));
  auto answer = std::make_shared<LocalDone>(std::move(done));
  const bool posted = inbox_->post([req, answer](DecodeEngine& e) {
    Result<std::vector<std::int32_t>> blocks = e.admit(std::move(*req));
    (*answer)(blocks.ok() ? okStatus() : Status(std::move(blocks).error()));
  });
  if (!posted) (*answer)(makeError(ErrorCode::Cancelled, "the decode loop has stopped"));
}

void DecodeLoop::openStreamAsync(DecodeRequest request, kvtransfer::Transport& transport,
                                 const kvtransfer::CompatInfo& compat, const std::vector<kvtransfer::KvTarget>& targets,
                                 std::uint32_t timeout_ms, OpenDone done) {
  auto wait = std::make_shared<KvWait>();
  wait->inbox = inbox_;
  wait->transport = &transport;
  wait->id = request.id;
  wait->deadline = request.kv_deadline;
  wait->failures_to_absorb = std::max<std::int64_t>(0, request.prefill_attempts - 1);
  request.stop_kv_wait = [wait] { wait->stop(); };
  request.end_kv_attempts = [wait] { wait->endAttempts(); };

  auto descriptor = std::make_shared<kvtransfer::KvDescriptor>();
  descriptor->compat = compat;
  descriptor->num_tokens = static_cast<std::uint32_t>(request.prompt_tokens);
  descriptor->timeout_ms = timeout_ms;
  descriptor->targets = targets;

  // Expect first, so that a record can never arrive unexpected; if admission then fails, the
  // cancelled expectation posts a Cancelled arrival for an unknown id, which the engine ignores.
  const Status expected = transport.expect(request.id, request.kv_deadline, waitArrival(wait));
  if (!expected.ok()) {
    done(expected.error());
    return;
  }
  auto req = std::make_shared<DecodeRequest>(std::move(request));
  auto answer = std::make_shared<OpenDone>(std::move(done));
  model::TpLeaderEngine* tp = tp_leader_;
  const bool posted = inbox_->post([req, wait, descriptor, answer, tp](DecodeEngine& e) {
    if (tp != nullptr) {
      // The followers' transports must expect the KV before the descriptor (listing their
      // targets) goes out, until the same deadline as ours. On the loop thread: no step runs
      // now, so this never waits for one.
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(wait->deadline - Clock::now()).count();
      const auto follower_ms = static_cast<std::uint32_t>(std::clamp<std::int64_t>(left, 1, UINT32_MAX));
      if (Status s = tp->expectKv(wait->id, follower_ms); !s.ok()) {
        wait->stop();
        (*answer)(s.error());
        return;
      }
      std::lock_guard lock(wait->mutex);
      if (!wait->stopped) wait->tp_leader = tp;
    }
    Result<std::vector<std::int32_t>> blocks = e.admit(std::move(*req));
    if (!blocks.ok()) {
      wait->stop();
      (*answer)(std::move(blocks).error());
      return;
    }
    descriptor->block_ids.reserve(blocks->size());
    for (const std::int32_t b : *blocks) descriptor->block_ids.push_back(static_cast<std::uint32_t>(b));
    // Leading blocks shared from the prefix cache: the prefill worker skips them and the grant
    // below leaves them read-only.
    descriptor->present_tokens = static_cast<std::uint32_t>(e.presentTokens(wait->id));
    // Bind the request to a fresh 128-bit random transfer id, the only id its descriptor and
    // records carry, and confine the transport to these blocks (docs/kv-transfer.md, "Transfer
    // ids", "Write confinement"); with tensor parallelism every follower's transport too,
    // before the descriptor goes out.
    Result<kvtransfer::KvDescriptor> granted = wait->transport->grant(wait->id, std::move(*descriptor));
    if (granted.ok() && tp != nullptr) {
      // Each follower grants the same pool blocks; a rank on the staging path answers with its own
      // staging blocks, which its target in the descriptor then names (KvTarget::block_ids).
      const std::vector<std::uint8_t> bytes = kvtransfer::encode(*granted);
      const std::uint32_t block_size = granted->compat.block_size;
      const auto prompt_blocks =
          static_cast<std::uint32_t>((std::uint64_t{granted->num_tokens} + block_size - 1) / block_size);
      Result<std::vector<std::vector<std::uint32_t>>> ids =
          tp->grantKv(wait->id, std::as_bytes(std::span(bytes)), prompt_blocks);
      if (!ids.ok()) {
        granted = std::move(ids).error();
      } else {
        for (kvtransfer::KvTarget& t : granted->targets) {
          if (t.tp_rank != 0 && t.tp_rank < ids->size() && !(*ids)[t.tp_rank].empty()) {
            t.block_ids = std::move((*ids)[t.tp_rank]);
          }
        }
      }
    }
    if (!granted.ok()) {
      wait->stop();  // the Cancelled arrival frees the admitted request's blocks
      (*answer)(std::move(granted).error());
      return;
    }
    (*answer)(std::move(*granted));
  });
  if (!posted) {
    wait->stop();
    (*answer)(makeError(ErrorCode::Cancelled, "the decode loop has stopped"));
  }
}

Result<kvtransfer::KvDescriptor> DecodeLoop::openStream(DecodeRequest request, kvtransfer::Transport& transport,
                                                        const kvtransfer::CompatInfo& compat,
                                                        const std::vector<kvtransfer::KvTarget>& targets,
                                                        std::uint32_t timeout_ms) {
  auto answer = std::make_shared<std::promise<Result<kvtransfer::KvDescriptor>>>();
  auto future = answer->get_future();
  openStreamAsync(std::move(request), transport, compat, targets, timeout_ms,
                  [answer](Result<kvtransfer::KvDescriptor> r) { answer->set_value(std::move(r)); });
  return future.get();
}

void DecodeLoop::attachAsync(std::uint64_t parent_id, std::int64_t choice, std::uint64_t child_id, TokenEventSink sink,
                             std::function<void(Status)> done) {
  auto answer = std::make_shared<std::function<void(Status)>>(std::move(done));
  auto own = std::make_shared<TokenEventSink>(std::move(sink));
  const bool posted = inbox_->post([parent_id, choice, child_id, own, answer](DecodeEngine& e) {
    (*answer)(e.attach(parent_id, choice, child_id, std::move(*own)));
  });
  if (!posted) (*answer)(makeError(ErrorCode::Cancelled, "the decode loop has stopped"));
}

void DecodeLoop::postKvReady(std::uint64_t request_id, Result<kvtransfer::CompletionRecord> record) {
  auto rec = std::make_shared<Result<kvtransfer::CompletionRecord>>(std::move(record));
  post([request_id, rec](DecodeEngine& e) { (void)e.onKvReady(request_id, std::move(*rec)); });
}

void DecodeLoop::postAbort(std::uint64_t request_id) {
  post([request_id](DecodeEngine& e) { e.abort(request_id); });
}

kvtransfer::ArrivalFn DecodeLoop::arrivalFn() {
  return [inbox = inbox_](std::uint64_t request_id, Result<kvtransfer::CompletionRecord> record) {
    auto rec = std::make_shared<Result<kvtransfer::CompletionRecord>>(std::move(record));
    inbox->post([request_id, rec](DecodeEngine& e) { (void)e.onKvReady(request_id, std::move(*rec)); });
  };
}

void DecodeLoop::runOnLoop(const std::function<void(DecodeEngine&)>& fn) {
  auto done = std::make_shared<std::promise<void>>();
  auto future = done->get_future();
  post([&fn, done](DecodeEngine& e) {
    fn(e);
    done->set_value();
  });
  future.get();
}

void DecodeLoop::run() {
  Inbox& in = *inbox_;
  bool stepping = false;  // a step is computing on the compute thread
  for (;;) {
    std::deque<Command> batch;
    bool closed = false;
    bool computed = false;
    {
      std::unique_lock lock(in.mutex);
      if (stepping) {
        // Commands are served while the step computes; the step completes once it is done.
        in.wake.wait(lock, [&] { return !in.commands.empty() || compute_done_; });
        computed = std::exchange(compute_done_, false);
      } else if (in.commands.empty() && !in.closed && !engine_.hasWork()) {
        const auto deadline = engine_.nextKvDeadline();
        const auto ready = [&in] { return !in.commands.empty() || in.closed; };
        if (deadline) {
          in.wake.wait_until(lock, *deadline, ready);
        } else {
          in.wake.wait(lock, ready);
        }
      }
      batch.swap(in.commands);
      closed = in.closed;
      if (!stepping && closed && batch.empty()) break;
    }
    for (Command& c : batch) c(engine_);
    if (stepping) {
      if (!computed) continue;
      stepping = false;
      engine_.completeStep();
    }
    if (closed) continue;  // no new step: what is queued is served, then the loop ends
    if (!overlap_) {
      engine_.step(Clock::now());
      continue;
    }
    if (!engine_.prepareStep(Clock::now())) continue;
    {
      std::lock_guard lock(compute_mutex_);
      compute_requested_ = true;
    }
    compute_wake_.notify_one();
    stepping = true;
  }
  // Requests still held end as aborted in ~DecodeEngine, after the thread has been joined.
}

}  // namespace pd::decode
