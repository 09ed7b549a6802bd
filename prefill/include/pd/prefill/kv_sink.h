#pragma once
/// Where a prefill request's latent KV and its outcome go (DESIGN §3 step 3): the seam
/// between the prefill engine loop and the KV data plane. The transport-backed implementation is
/// TransportKvSink (transport_kv_sink.h); tests use an in-memory one.
///
/// Call order, per request: admitted() when it leaves the queue (not for a request that ends
/// while queued), any number of putLayer() calls (a cached prefix's rows of every layer at
/// admission; then each main layer 0..L-1 of each chunk as soon as it is computed; then, after
/// the last chunk, the MTP layer L chunk by chunk over the positions after the cached prefix),
/// then exactly one of complete() or fail(). After complete()/fail() the engine never calls the sink again
/// and destroys it.
///
/// Thread rules: every method is called on the prefill engine thread only, and must not block on
/// the network (post and return).

#include <chrono>
#include <cstdint>
#include <span>

#include "pd/common/result.h"
#include "pd/kvtransfer/wire.h"

namespace pd::prefill {

class KvSink {
 public:
  KvSink() = default;
  virtual ~KvSink() = default;
  KvSink(const KvSink&) = delete;
  KvSink& operator=(const KvSink&) = delete;
  KvSink(KvSink&&) = delete;
  KvSink& operator=(KvSink&&) = delete;

  /// The engine admitted the request into its running set: its first forward comes next (the end
  /// of its queueing time). Called once, before any putLayer(); the default does nothing.
  virtual void admitted() {}
  /// The first `tokens` prompt positions come from the prefix cache (not recomputed; their
  /// layers are still put). Called at most once, right after admitted(); the default ignores it.
  virtual void prefixCached(std::int64_t tokens) { (void)tokens; }
  /// A forward over prompt positions [first_pos, first_pos + n) of this request ran from `start`
  /// to `end` (its batch may hold other requests' rows); `mtp` for a chunk of the MTP layer's
  /// pass. Called after the forward's putLayer() calls, whatever its outcome. For traces;
  /// the default ignores it.
  virtual void forwardTimed(std::int64_t first_pos, std::int64_t n, bool mtp,
                            std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point end) {
    (void)first_pos, (void)n, (void)mtp, (void)start, (void)end;
  }
  /// Latent KV of KV layer `layer` (main layers, then MTP) for prompt positions
  /// [first_pos, first_pos + n): `rows` is [n, latent_dim] float32 (normalized c_kv ‖ roped
  /// k_pe), valid only during the call — copy what must outlive it. An error fails the request
  /// (the engine then calls fail() with it).
  [[nodiscard]] virtual Status putLayer(std::uint32_t layer, std::int64_t first_pos, std::span<const float> rows) = 0;
  /// Every layer of every prompt position has been put. `record` has num_tokens,
  /// first_token, hidden_state and (when asked) logprobs; compat_hash is left to the transport.
  virtual void complete(kvtransfer::CompletionRecord record) = 0;
  /// The request ended without a result (Cancelled, Timeout, a compute or put error).
  virtual void fail(const Error& reason) = 0;
};

}  // namespace pd::prefill
