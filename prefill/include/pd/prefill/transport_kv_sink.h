#pragma once
/// A KvSink over kvtransfer's Transport (transport.h): the prefill side of one request's KV
/// transfer. Each putLayer() converts the rows to the descriptor's cache dtype into a staging
/// buffer registered with the transport ([num_layers][num_tokens][token bytes]) and posts one
/// put of that layer slice; the transport writes token t of layer l into the decode worker's
/// block block_ids[t / block_size] at offset t % block_size (DESIGN §4). Rows of the tokens the
/// decode worker already holds (KvDescriptor::present_tokens, its prefix cache) are not put: the
/// engine computes them, the sink drops them. complete() hands the
/// record to Transport::finish(), which sends it once every put is remotely complete; fail()
/// (and destruction before either) calls Transport::abort().
///
/// The staging buffer lives until the transport's done callback, not the sink: the transport
/// may still read it after the engine has dropped the sink.
///
/// A TransferTimeline, when given, records what the engine told the sink (admitted, computed
/// with its first token, or its failure reason) for whoever answers the transfer's submitter.
///
/// Thread rules: KvSink calls on the engine thread only. `on_done` runs on the transport's
/// progress thread exactly once (success, failure, cancel or deadline) and must not block.
/// TransferTimeline is thread-safe.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "pd/common/result.h"
#include "pd/kvtransfer/transport.h"
#include "pd/prefill/kv_sink.h"

namespace pd::prefill {

/// One request's timeline as its sink saw it, plus the first reason it failed. The engine's
/// reason (fail()) is recorded before the sink aborts the transfer, so a done callback that
/// reads it explains the end better than the transport's Cancelled that follows. Others (a
/// cancel, a refused submit) record theirs with failed() too; the first reason wins.
///
/// A detailed timeline (a traced request) also keeps each forward's times and each layer put's
/// posting time, for the request's spans (docs/observability.md).
class TransferTimeline {
 public:
  using Clock = std::chrono::steady_clock;
  struct Forward {
    std::int64_t first_pos = 0;
    std::int64_t tokens = 0;
    bool mtp = false;
    Clock::time_point start;
    Clock::time_point end;
  };
  struct Put {
    std::uint32_t layer = 0;
    std::int64_t first_pos = 0;
    Clock::time_point posted;
  };
  struct Snapshot {
    std::optional<Clock::time_point> admitted;
    std::optional<Clock::time_point> computed;
    std::int32_t first_token = 0;
    std::int64_t cached_tokens = 0;  ///< prompt tokens served from the prefix cache
    std::optional<Error> failure;
    std::vector<Forward> forwards;  ///< detailed only
    std::vector<Put> puts;          ///< detailed only
  };

  explicit TransferTimeline(bool detailed = false) : detailed_(detailed) {}

  void admitted();
  void prefixCached(std::int64_t tokens);
  void computed(std::int32_t first_token);
  void failed(const Error& reason);
  /// Detailed timelines only (otherwise no-ops).
  void forward(Forward f);
  void put(std::uint32_t layer, std::int64_t first_pos);
  [[nodiscard]] bool detailed() const { return detailed_; }
  [[nodiscard]] Snapshot snapshot() const;

 private:
  const bool detailed_;
  mutable std::mutex mutex_;
  Snapshot state_;  // guarded by mutex_
};

class TransportKvSink final : public KvSink {
 public:
  /// Registers the staging buffer and begins the transfer (Transport::beginTransfer, which
  /// validates the descriptor). On error nothing stays registered and on_done is never called.
  /// `transport` must outlive the transfer (until on_done). `timeline` (optional) hears the
  /// engine's calls. `record_traceparent` (may be empty) goes into the completion record
  /// (CompletionRecord::traceparent): the context of the request's `prefill.completion` span.
  [[nodiscard]] static Result<std::unique_ptr<TransportKvSink>> create(
      kvtransfer::Transport& transport, kvtransfer::KvDescriptor descriptor, kvtransfer::Deadline deadline,
      kvtransfer::TransferDoneFn on_done, std::shared_ptr<TransferTimeline> timeline = nullptr,
      std::string record_traceparent = {});
  /// Aborts the transfer with Cancelled when neither complete() nor fail() was called (the
  /// timeline records nothing: dropping a sink is not the engine's failure).
  ~TransportKvSink() override;
  TransportKvSink(const TransportKvSink&) = delete;
  TransportKvSink& operator=(const TransportKvSink&) = delete;
  TransportKvSink(TransportKvSink&&) = delete;
  TransportKvSink& operator=(TransportKvSink&&) = delete;

  /// InvalidArgument for a layer or positions outside the descriptor or rows of the wrong width;
  /// the transport's error when the put is refused (NotFound once the transfer has ended).
  void admitted() override;
  void prefixCached(std::int64_t tokens) override;
  void forwardTimed(std::int64_t first_pos, std::int64_t n, bool mtp, std::chrono::steady_clock::time_point start,
                    std::chrono::steady_clock::time_point end) override;
  [[nodiscard]] Status putLayer(std::uint32_t layer, std::int64_t first_pos, std::span<const float> rows) override;
  void complete(kvtransfer::CompletionRecord record) override;
  void fail(const Error& reason) override;

  struct Staging;

 private:
  TransportKvSink(kvtransfer::Transport& transport, kvtransfer::KvDescriptor descriptor,
                  std::shared_ptr<Staging> staging, std::shared_ptr<TransferTimeline> timeline,
                  std::string record_traceparent);
  // Ends the transfer with `reason` (Transport::abort).
  void abortTransfer(const Error& reason);

  kvtransfer::Transport& transport_;
  const kvtransfer::KvDescriptor descriptor_;
  std::shared_ptr<Staging> staging_;            // shared with the done callback, which outlives the sink
  std::shared_ptr<TransferTimeline> timeline_;  // may be null; shared with the submitter
  const std::string record_traceparent_;        // the completion record's trace context
  bool ended_ = false;
};

}  // namespace pd::prefill
