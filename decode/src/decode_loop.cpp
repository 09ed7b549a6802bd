#include "pd/decode/decode_loop.h"

#include <future>
#include <memory>
#include <utility>

namespace pd::decode {

DecodeLoop::DecodeLoop(model::Engine& engine, KvPool& pool, DecodeEngineOptions options)
    : engine_(engine, pool, options), thread_([this] { run(); }) {}

DecodeLoop::~DecodeLoop() {
  {
    std::lock_guard lock(inbox_->mutex);
    inbox_->closed = true;
  }
  inbox_->wake.notify_one();
  thread_.join();
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

Result<kvtransfer::KvDescriptor> DecodeLoop::openStream(DecodeRequest request, kvtransfer::Transport& transport,
                                                        const kvtransfer::CompatInfo& compat,
                                                        const std::vector<kvtransfer::KvTarget>& targets,
                                                        std::uint32_t timeout_ms) {
  const std::uint64_t id = request.id;
  const auto prompt_tokens = static_cast<std::uint32_t>(request.prompt_tokens);
  // Expect first, so that a record can never arrive unexpected; if admission then fails, the
  // cancelled expectation posts a Cancelled arrival for an unknown id, which the engine ignores.
  PD_TRY(transport.expect(id, request.kv_deadline, arrivalFn()));
  Result<std::vector<std::int32_t>> blocks = admit(std::move(request));
  if (!blocks.ok()) {
    transport.cancelExpect(id);
    return std::move(blocks).error();
  }
  kvtransfer::KvDescriptor descriptor;
  descriptor.request_id = id;
  descriptor.compat = compat;
  descriptor.num_tokens = prompt_tokens;
  descriptor.timeout_ms = timeout_ms;
  descriptor.block_ids.reserve(blocks->size());
  for (const std::int32_t b : *blocks) descriptor.block_ids.push_back(static_cast<std::uint32_t>(b));
  descriptor.targets = targets;
  return descriptor;
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
  for (;;) {
    std::deque<Command> batch;
    {
      std::unique_lock lock(in.mutex);
      if (in.commands.empty() && !in.closed && !engine_.hasWork()) {
        const auto deadline = engine_.nextKvDeadline();
        const auto ready = [&in] { return !in.commands.empty() || in.closed; };
        if (deadline) {
          in.wake.wait_until(lock, *deadline, ready);
        } else {
          in.wake.wait(lock, ready);
        }
      }
      batch.swap(in.commands);
      if (in.closed && batch.empty()) break;
    }
    for (Command& c : batch) c(engine_);
    engine_.step(Clock::now());
  }
  // Requests still held end as aborted in ~DecodeEngine, after the thread has been joined.
}

}  // namespace pd::decode
