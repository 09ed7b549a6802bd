#pragma once
/// The decode worker's engine loop thread (STYLE "Concurrency"): one thread owns the
/// DecodeEngine — and through it the block manager, the KV pool's reads and writes by the model,
/// and the model engine — and runs step() while there is work. Other threads (HTTP handlers, the
/// transport's progress thread) only post commands to it.
///
/// Blocking: admit() waits for the loop thread to answer (admission needs the block manager);
/// postKvReady() and postAbort() never block beyond a short lock, so they may be called from a
/// transport callback. When idle, the loop sleeps until a command arrives or the earliest KV
/// deadline passes.
///
/// Overlapped steps (DecodeEngineOptions::overlap_steps; docs/kv-memory.md "Overlapped steps"):
/// the loop thread prepares a step (DecodeEngine::prepareStep), hands its forwards to a compute
/// thread (computeStep) and, until they are done, keeps serving commands: admissions and opens
/// (so a prefill worker gets its descriptor without waiting for the step), KV arrivals (a
/// request's first token streams at once), attaches, aborts (of a request in the running step:
/// applied when it completes). Then it completes the step (completeStep: the tokens stream) and
/// prepares the next. Without it, each step runs whole on the loop thread between commands.
///
/// Thread rules: every public method is thread-safe. Sinks run on the loop thread (must not
/// block, must not call back into the loop). The destructor stops the thread after aborting every
/// request still held (each sink hears Aborted); the engine and pool must outlive the loop.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "pd/common/result.h"
#include "pd/decode/decode_engine.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/kvtransfer/transport.h"

namespace pd::model {
class TpLeaderEngine;
}  // namespace pd::model

namespace pd::decode {

class DecodeLoop {
 public:
  /// Starts the loop thread. `tp_leader` (may be null): the tensor-parallel leader engine
  /// (`engine` itself, seen as such); when set, every opened stream's KV expectation is relayed
  /// to the followers (model::TpLeaderEngine::expectKv / cancelKv) on the loop thread, and so is
  /// the granted descriptor (grantKv: every rank's transport confined to the request's blocks
  /// before the descriptor goes out); an open whose relay fails (a broken group: PeerFailed; a
  /// follower that cannot confine: Internal) fails with that error, nothing held.
  DecodeLoop(model::Engine& engine, KvPool& pool, DecodeEngineOptions options,
             model::TpLeaderEngine* tp_leader = nullptr);
  ~DecodeLoop();
  DecodeLoop(const DecodeLoop&) = delete;
  DecodeLoop& operator=(const DecodeLoop&) = delete;
  DecodeLoop(DecodeLoop&&) = delete;
  DecodeLoop& operator=(DecodeLoop&&) = delete;

  /// DecodeEngine::admit on the loop thread; blocks until it answers. Never call it from the
  /// loop thread (a sink): it would wait on itself.
  [[nodiscard]] Result<std::vector<std::int32_t>> admit(DecodeRequest request);
  /// Opens a request's decode stream (DESIGN §3 step 2): arms `transport` to expect its KV
  /// record until request.kv_deadline, admits it, and returns the descriptor the prefill worker
  /// writes by (`compat`, the admitted block ids, `targets` from Transport::exportTarget, and
  /// `timeout_ms`). Admission errors as admit(); the transport's expect() errors as they are.
  /// On any error nothing is held: no blocks, no pending expectation, and the sink is not called.
  /// Request ids must not be reused: a cancelled expectation's answer may reach the loop late.
  ///
  /// Prefill retries (docs/internal-api.md): while request.prefill_attempts - 1 failures remain
  /// to absorb, a failure outcome of the expectation other than Timeout (a prefill worker's
  /// failure record, a record that does not match the compatibility hash) re-arms the same id
  /// with the same deadline at once, on the transport's thread — before the router can start the
  /// next attempt — and the request keeps its blocks (DecodeEngine::noteKvRetry counts it).
  /// When the request ends while waiting (abort, deadline), the expectation is cancelled and no
  /// longer re-armed — except for an abort with DecodeEngineOptions::quarantine_late_writes: the
  /// expectation then stays armed (not re-armed) until its outcome or the deadline ends the
  /// blocks' quarantine (decode_engine.h, "Late writes"). `transport` must outlive this loop. Blocks like admit().
  [[nodiscard]] Result<kvtransfer::KvDescriptor> openStream(DecodeRequest request, kvtransfer::Transport& transport,
                                                            const kvtransfer::CompatInfo& compat,
                                                            const std::vector<kvtransfer::KvTarget>& targets,
                                                            std::uint32_t timeout_ms);
  /// openStream() without blocking the caller: `done` gets the outcome on the loop thread, before
  /// any sink call of the request (so it may write the descriptor ahead of the tokens), or on the
  /// calling thread when the transport refuses the expectation. `done` must not block.
  using OpenDone = std::function<void(Result<kvtransfer::KvDescriptor>)>;
  void openStreamAsync(DecodeRequest request, kvtransfer::Transport& transport, const kvtransfer::CompatInfo& compat,
                       const std::vector<kvtransfer::KvTarget>& targets, std::uint32_t timeout_ms, OpenDone done);
  /// A request this worker prefills itself (DecodeRequest::local_prompt, conditional
  /// disaggregation): admitted on the loop thread with no KV expectation and no descriptor;
  /// `done` gets the admission's outcome there, before any sink call of the request (or on the
  /// calling thread when the loop has stopped). `done` must not block.
  using LocalDone = std::function<void(Status)>;
  void openLocalAsync(DecodeRequest request, LocalDone done);
  /// DecodeEngine::attach on the loop thread; `done` gets its outcome there, before any call of
  /// `sink` (so it may write the stream's first line), and must not block.
  void attachAsync(std::uint64_t parent_id, std::int64_t choice, std::uint64_t child_id, TokenEventSink sink,
                   std::function<void(Status)> done);
  /// DecodeEngine::onKvReady on the loop thread (an unknown id is ignored: it was aborted).
  void postKvReady(std::uint64_t request_id, Result<kvtransfer::CompletionRecord> record);
  /// DecodeEngine::abort on the loop thread (the client went away, the router cancelled).
  void postAbort(std::uint64_t request_id);
  /// An ArrivalFn for Transport::expect() that posts the outcome to this loop. Safe to call
  /// after the loop is destroyed (the outcome is dropped then).
  [[nodiscard]] kvtransfer::ArrivalFn arrivalFn();
  /// Runs `fn` on the loop thread and waits for it (tests, metrics snapshots). With overlapped
  /// steps it may run while a step computes: read-only calls only.
  void runOnLoop(const std::function<void(DecodeEngine&)>& fn);

 private:
  using Command = std::function<void(DecodeEngine&)>;
  // Commands for the loop thread. Shared with the ArrivalFns handed to transports, which may
  // outlive the loop: after close, posts are dropped instead of touching a destroyed loop.
  struct Inbox {
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<Command> commands;  // guarded by mutex
    bool closed = false;           // guarded by mutex
    // False (and the command dropped) once the loop has stopped.
    bool post(Command command);
  };
  // The transport expectation of one opened stream (openStream): shared by the ArrivalFns handed
  // to the transport and the request's stop_kv_wait.
  struct KvWait;
  static kvtransfer::ArrivalFn waitArrival(std::shared_ptr<KvWait> wait);

  void post(Command command) { inbox_->post(std::move(command)); }
  void run();
  // The compute thread (overlap_steps): DecodeEngine::computeStep each time the loop asks.
  void compute();

  model::TpLeaderEngine* tp_leader_ = nullptr;
  const bool overlap_;
  DecodeEngine engine_;  // loop thread only once the thread runs (computeStep: the compute thread)
  std::shared_ptr<Inbox> inbox_ = std::make_shared<Inbox>();
  // Hand-off to the compute thread: requested / stop guarded by compute_mutex_; done (the step
  // computed) guarded by inbox_->mutex, so that the loop waits for it and commands at once.
  std::mutex compute_mutex_;
  std::condition_variable compute_wake_;
  bool compute_requested_ = false;
  bool compute_stop_ = false;
  bool compute_done_ = false;
  std::thread compute_thread_;  // started (overlap_steps) before the loop thread
  std::thread thread_;          // last: started after everything it uses exists
};

}  // namespace pd::decode
