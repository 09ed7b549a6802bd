// Tensor-parallel leader engine and follower loop (tp_engine.h): the call message and its codec.
#include "pd/engine/tp_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <type_traits>
#include <vector>

#include "pd/common/log.h"

namespace pd::model {
namespace {

enum class CallKind : std::uint32_t {
  Stop = 0x54505300,
  Forward = 0x54504601,
  ForwardMtp = 0x5450460d,
  ExpectKv = 0x54504b01,
  CancelKv = 0x54504b02,
  GrantKv = 0x54504b03,
  AwaitKv = 0x54504b04,
  ForwardSampled = 0x54504653,  // Forward, then the number of sampled (logits) rows
};

class Writer {
 public:
  template <class T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  template <class T>
  void putSpan(std::span<const T> v) {
    put<std::uint64_t>(v.size());
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    bytes_.insert(bytes_.end(), p, p + v.size_bytes());
  }
  std::vector<std::byte> take() { return std::move(bytes_); }

 private:
  std::vector<std::byte> bytes_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <class T>
  bool get(T& v) {
    if (bytes_.size() - at_ < sizeof(T)) return false;
    std::memcpy(&v, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  template <class T>
  bool getVector(std::vector<T>& v) {
    std::uint64_t n = 0;
    if (!get(n) || n > (bytes_.size() - at_) / sizeof(T)) return false;
    v.resize(n);
    if (n > 0) std::memcpy(v.data(), bytes_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return true;
  }
  [[nodiscard]] bool done() const { return at_ == bytes_.size(); }

 private:
  std::span<const std::byte> bytes_;
  std::size_t at_ = 0;
};

TpCacheGeometry geometryOf(const model::LatentCacheView& v) {
  return {v.dtype, v.latent_dim, v.block_size, v.num_blocks, static_cast<std::int64_t>(v.layers.size())};
}

std::vector<std::byte> encodeCall(CallKind kind, std::span<const model::SequenceChunk> batch,
                                  const model::LatentCacheView& cache, const model::ForwardOptions& o,
                                  std::uint64_t sampled_rows = 0) {
  Writer w;
  w.put(static_cast<std::uint32_t>(kind));
  if (kind == CallKind::Stop) return w.take();
  w.put(static_cast<std::uint8_t>(o.attention));
  w.put(static_cast<std::uint8_t>(o.logits));
  w.put(static_cast<std::uint8_t>(o.hidden));
  w.put(static_cast<std::uint8_t>(o.mtp_zero_position0_embedding ? 1 : 0));
  const TpCacheGeometry g = geometryOf(cache);
  w.put(static_cast<std::int32_t>(g.dtype));
  w.put(g.latent_dim);
  w.put(g.block_size);
  w.put(g.num_blocks);
  w.put(g.layers);
  w.put<std::uint64_t>(batch.size());
  for (const model::SequenceChunk& s : batch) {
    w.put(s.start_pos);
    w.put(s.rope_offset);
    w.putSpan(s.tokens);
    w.putSpan(s.block_table);
    w.putSpan(s.prev_hidden);
  }
  if (kind == CallKind::ForwardSampled) w.put(sampled_rows);
  return w.take();
}

struct DecodedSequence {
  std::int64_t start_pos = 0;
  std::int64_t rope_offset = 0;
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> blocks;
  std::vector<float> prev_hidden;
};

std::vector<std::byte> encodeKv(CallKind kind, std::uint64_t request_id, std::uint32_t timeout_ms) {
  Writer w;
  w.put(static_cast<std::uint32_t>(kind));
  w.put(request_id);
  w.put(timeout_ms);
  return w.take();
}

std::vector<std::byte> encodeGrant(std::uint64_t request_id, std::span<const std::byte> grant, std::uint32_t blocks) {
  Writer w;
  w.put(static_cast<std::uint32_t>(CallKind::GrantKv));
  w.put(request_id);
  w.put(blocks);
  w.putSpan(grant);
  return w.take();
}

// Most blocks one grant may name (a prompt of max_position_embeddings in blocks of 1 token).
constexpr std::uint32_t kMaxGrantBlocks = 1U << 22;

// A rank's answer to a grant in the allGather: a status word (0: not applied, 1: the descriptor's
// block ids, 2: its own ids) and `blocks` ids (zero unless its own).
std::vector<std::uint32_t> grantAnswer(const std::optional<std::vector<std::uint32_t>>& ids, std::uint32_t blocks) {
  std::vector<std::uint32_t> answer(std::size_t{blocks} + 1, 0);
  if (!ids) return answer;
  if (ids->empty()) {
    answer[0] = 1;
  } else if (ids->size() == blocks) {
    answer[0] = 2;
    std::copy(ids->begin(), ids->end(), answer.begin() + 1);
  }
  return answer;
}

struct DecodedCall {
  CallKind kind = CallKind::Stop;
  std::uint64_t request_id = 0;  // ExpectKv / CancelKv / GrantKv: the leader's local handle
  std::uint32_t timeout_ms = 0;
  std::vector<std::byte> grant;    // GrantKv
  std::uint32_t grant_blocks = 0;  // GrantKv: the ids each rank answers with
  model::ForwardOptions options;
  TpCacheGeometry geometry;
  std::vector<DecodedSequence> sequences;
  std::uint64_t sampled_rows = 0;  // ForwardSampled
};

Result<DecodedCall> decodeCall(std::span<const std::byte> bytes) {
  const auto corrupt = [] { return makeError(ErrorCode::Corrupt, "tensor-parallel call message is malformed"); };
  Reader r(bytes);
  DecodedCall c;
  std::uint32_t kind = 0;
  if (!r.get(kind)) return corrupt();
  c.kind = static_cast<CallKind>(kind);
  if (c.kind == CallKind::Stop) return r.done() ? Result<DecodedCall>(std::move(c)) : corrupt();
  if (c.kind == CallKind::ExpectKv || c.kind == CallKind::CancelKv || c.kind == CallKind::AwaitKv) {
    if (!r.get(c.request_id) || !r.get(c.timeout_ms) || !r.done()) return corrupt();
    return c;
  }
  if (c.kind == CallKind::GrantKv) {
    if (!r.get(c.request_id) || !r.get(c.grant_blocks) || !r.getVector(c.grant) || !r.done() ||
        c.grant_blocks > kMaxGrantBlocks) {
      return corrupt();
    }
    return c;
  }
  if (c.kind != CallKind::Forward && c.kind != CallKind::ForwardMtp && c.kind != CallKind::ForwardSampled) {
    return corrupt();
  }
  std::uint8_t attention = 0, logits = 0, hidden = 0, zero = 0;
  std::int32_t dtype = 0;
  std::uint64_t n = 0;
  if (!r.get(attention) || !r.get(logits) || !r.get(hidden) || !r.get(zero) || !r.get(dtype) ||
      !r.get(c.geometry.latent_dim) || !r.get(c.geometry.block_size) || !r.get(c.geometry.num_blocks) ||
      !r.get(c.geometry.layers) || !r.get(n) || attention > 2 || logits > 2 || hidden > 2 || n > (1U << 24)) {
    return corrupt();
  }
  c.options.attention = static_cast<model::AttentionPath>(attention);
  c.options.logits = static_cast<model::OutputRows>(logits);
  c.options.hidden = static_cast<model::OutputRows>(hidden);
  c.options.mtp_zero_position0_embedding = zero != 0;
  c.geometry.dtype = static_cast<DType>(dtype);
  c.sequences.resize(n);
  for (DecodedSequence& s : c.sequences) {
    if (!r.get(s.start_pos) || !r.get(s.rope_offset) || !r.getVector(s.tokens) || !r.getVector(s.blocks) ||
        !r.getVector(s.prev_hidden)) {
      return corrupt();
    }
  }
  if (c.kind == CallKind::ForwardSampled && (!r.get(c.sampled_rows) || c.sampled_rows > (1U << 24))) return corrupt();
  if (!r.done()) return corrupt();
  return c;
}

bool isCommunicationError(const Error& e) {
  return e.code == ErrorCode::PeerFailed || e.code == ErrorCode::Timeout;
}

}  // namespace

TpLeaderEngine::TpLeaderEngine(std::unique_ptr<model::Engine> local, comm::Communicator& comm)
    : local_(std::move(local)), comm_(comm) {
  PD_CHECK(comm_.rank() == 0);
}

TpLeaderEngine::~TpLeaderEngine() {
  try {
    if (Status s = stop(); !s.ok()) log::warn("tp", "stopping the tensor-parallel followers: {}", s.error().toString());
  } catch (const std::exception& e) {
    // A destructor must not throw (the lock, an allocation or the log line failed): say so plainly.
    std::fprintf(stderr, "tp: stopping the tensor-parallel followers failed: %s\n", e.what());
  }
}

model::EngineCapabilities TpLeaderEngine::capabilities() const {
  model::EngineCapabilities c = local_->capabilities();
  c.backend += fmt::format(" tp{}", comm_.size());
  return c;
}

Status TpLeaderEngine::stop() {
  std::lock_guard lock(mu_);
  if (stopped_ || broken_) return okStatus();
  stopped_ = true;
  auto sent = comm::broadcastMessage(comm_, encodeCall(CallKind::Stop, {}, {}, {}), 0);
  if (!sent.ok()) return std::move(sent).error();
  return okStatus();
}

Status TpLeaderEngine::send(std::vector<std::byte> message) {
  if (broken_) return *broken_;
  if (stopped_) return makeError(ErrorCode::Cancelled, "the tensor-parallel group was stopped");
  auto sent = comm::broadcastMessage(comm_, std::move(message), 0);
  if (!sent.ok()) {
    broken_ = std::move(sent).error();
    failed_.store(true);
    return *broken_;
  }
  return okStatus();
}

void TpLeaderEngine::markBroken(Error why) {
  std::lock_guard lock(mu_);
  if (broken_ || stopped_) return;
  broken_ = std::move(why);
  failed_.store(true);
}

Status TpLeaderEngine::expectKv(std::uint64_t request_id, std::uint32_t timeout_ms) {
  std::lock_guard lock(mu_);
  return send(encodeKv(CallKind::ExpectKv, request_id, timeout_ms));
}

Result<std::vector<std::vector<std::uint32_t>>> TpLeaderEngine::grantKv(std::uint64_t request_id,
                                                                        std::span<const std::byte> grant,
                                                                        std::uint32_t blocks) {
  if (blocks > kMaxGrantBlocks) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("a KV grant of {} blocks", blocks));
  }
  std::lock_guard lock(mu_);
  PD_TRY(send(encodeGrant(request_id, grant, blocks)));
  // Every rank answers whether it applied the grant and, on the staging path, its own block ids;
  // the descriptor goes out only after every follower's transport is confined.
  const std::vector<std::uint32_t> mine = grantAnswer(std::vector<std::uint32_t>{}, blocks);
  std::vector<std::uint32_t> all(mine.size() * static_cast<std::size_t>(comm_.size()));
  PD_TRY(breakOnFailure(comm_.allGather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)))));
  std::vector<std::vector<std::uint32_t>> ids(static_cast<std::size_t>(comm_.size()));
  int refused = 0;
  for (int r = 1; r < comm_.size(); ++r) {
    const auto answer = std::span(all).subspan(static_cast<std::size_t>(r) * mine.size(), mine.size());
    if (answer[0] == 2) {
      ids[static_cast<std::size_t>(r)].assign(answer.begin() + 1, answer.end());
    } else if (answer[0] != 1) {
      ++refused;
    }
  }
  if (refused > 0) {
    return makeError(ErrorCode::Internal,
                     fmt::format("{} of {} follower rank(s) could not confine their KV transport to the request",
                                 refused, comm_.size() - 1));
  }
  return ids;
}

Status TpLeaderEngine::awaitKv(std::uint64_t request_id, std::uint32_t timeout_ms) {
  std::lock_guard lock(mu_);
  PD_TRY(send(encodeKv(CallKind::AwaitKv, request_id, timeout_ms)));
  float landed = 1.0F;
  PD_TRY(breakOnFailure(comm_.allReduceSum(std::span(&landed, 1))));
  if (landed != static_cast<float>(comm_.size())) {
    return makeError(ErrorCode::Internal,
                     fmt::format("the KV of request {} did not land on {} of {} follower rank(s)", request_id,
                                 comm_.size() - static_cast<int>(landed), comm_.size() - 1));
  }
  return okStatus();
}

Status TpLeaderEngine::cancelKv(std::uint64_t request_id) {
  std::lock_guard lock(mu_);
  return send(encodeKv(CallKind::CancelKv, request_id, 0));
}

Result<model::ForwardOutput> TpLeaderEngine::forward(std::span<const model::SequenceChunk> batch,
                                                     const model::LatentCacheView& cache,
                                                     const model::ForwardOptions& options) {
  return call(false, batch, cache, options);
}

Result<model::ForwardOutput> TpLeaderEngine::forwardMtp(std::span<const model::SequenceChunk> batch,
                                                        const model::LatentCacheView& cache,
                                                        const model::ForwardOptions& options) {
  return call(true, batch, cache, options);
}

Result<model::ForwardOutput> TpLeaderEngine::call(bool mtp, std::span<const model::SequenceChunk> batch,
                                                  const model::LatentCacheView& cache,
                                                  const model::ForwardOptions& options) {
  std::lock_guard lock(mu_);
  PD_TRY(send(encodeCall(mtp ? CallKind::ForwardMtp : CallKind::Forward, batch, cache, options)));
  auto out = mtp ? local_->forwardMtp(batch, cache, options) : local_->forward(batch, cache, options);
  if (!out.ok()) noteFailure(out.error());
  return out;
}

Status TpLeaderEngine::breakOnFailure(Status s) {
  if (!s.ok()) {
    broken_ = s.error();
    failed_.store(true);
  }
  return s;
}

void TpLeaderEngine::noteFailure(const Error& e) {
  if (!isCommunicationError(e)) return;
  broken_ = e;
  failed_.store(true);
}

Result<model::SampledForward> TpLeaderEngine::sampledCall(std::span<const model::SequenceChunk> batch,
                                                          const model::LatentCacheView& cache,
                                                          const model::ForwardOptions& options,
                                                          std::span<const model::RowSample> rows) {
  auto* sampling = dynamic_cast<model::SamplingEngine*>(local_.get());
  if (sampling == nullptr) {
    return makeError(ErrorCode::Unsupported, "tensor-parallel leader: the local engine does not sample");
  }
  std::lock_guard lock(mu_);
  PD_TRY(send(encodeCall(CallKind::ForwardSampled, batch, cache, options, rows.size())));
  auto out = sampling->forwardSampled(batch, cache, options, rows);
  if (!out.ok()) noteFailure(out.error());
  return out;
}

std::unique_ptr<TpLeaderEngine> makeTpLeaderEngine(std::unique_ptr<model::Engine> local, comm::Communicator& comm) {
  if (dynamic_cast<model::SamplingEngine*>(local.get()) != nullptr) {
    return std::make_unique<TpSamplingLeaderEngine>(std::move(local), comm);
  }
  return std::make_unique<TpLeaderEngine>(std::move(local), comm);
}

TpCacheProvider fixedTpCache(model::LatentCacheView view) {
  return [view = std::move(view)](const TpCacheGeometry& g) -> Result<model::LatentCacheView> {
    if (!(geometryOf(view) == g)) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("the leader's KV cache ({} blocks of {} x {}, {} layers) differs from this rank's "
                                   "({} blocks of {} x {}, {} layers)",
                                   g.num_blocks, g.block_size, g.latent_dim, g.layers, view.num_blocks, view.block_size,
                                   view.latent_dim, view.layers.size()));
    }
    return view;
  };
}

TpCacheProvider ownedTpCache() {
  // shared_ptr: std::function needs a copyable callable; the cache lives as long as the provider.
  auto cache = std::make_shared<std::optional<model::PagedLatentCache>>();
  return [cache](const TpCacheGeometry& g) -> Result<model::LatentCacheView> {
    if (!*cache || !(geometryOf((*cache)->view()) == g)) {
      cache->reset();
      PD_ASSIGN_OR_RETURN(model::PagedLatentCache c,
                          model::PagedLatentCache::create(g.layers, g.latent_dim, g.num_blocks, g.block_size, g.dtype));
      *cache = std::move(c);
    }
    return (*cache)->view();
  };
}

TpCacheProvider engineTpCache(model::Engine& engine) {
  auto memory = std::make_shared<std::unique_ptr<model::CacheMemory>>();
  return [memory, &engine](const TpCacheGeometry& g) -> Result<model::LatentCacheView> {
    if (!*memory || !(geometryOf((*memory)->view()) == g)) {
      memory->reset();
      PD_ASSIGN_OR_RETURN(*memory, engine.allocateCache(g.num_blocks, g.block_size, g.dtype));
      if (!(geometryOf((*memory)->view()) == g)) {
        memory->reset();
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("the leader's KV cache ({} layers of {}) differs from this rank's model", g.layers,
                                     g.latent_dim));
      }
    }
    return (*memory)->view();
  };
}

Status runTpFollower(model::Engine& engine, comm::Communicator& comm, const TpCacheProvider& cache,
                     const TpFollowerHooks& hooks) {
  PD_CHECK(comm.rank() != 0);
  auto* const sampling = dynamic_cast<model::SamplingEngine*>(&engine);
  while (true) {
    PD_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, comm::broadcastMessage(comm, {}, 0, /*unbounded=*/true));
    PD_ASSIGN_OR_RETURN(DecodedCall call, decodeCall(bytes));
    if (call.kind == CallKind::Stop) return okStatus();
    if (call.kind == CallKind::ExpectKv) {
      if (hooks.expect_kv) hooks.expect_kv(call.request_id, call.timeout_ms);
      continue;
    }
    if (call.kind == CallKind::CancelKv) {
      if (hooks.cancel_kv) hooks.cancel_kv(call.request_id);
      continue;
    }
    if (call.kind == CallKind::AwaitKv) {
      float landed = hooks.await_kv && hooks.await_kv(call.request_id, call.timeout_ms) ? 1.0F : 0.0F;
      PD_TRY(comm.allReduceSum(std::span(&landed, 1)));
      continue;
    }
    if (call.kind == CallKind::GrantKv) {
      // A follower without a grant hook cannot confine anything: it says so (fails closed).
      std::optional<std::vector<std::uint32_t>> ids;
      if (hooks.grant_kv) ids = hooks.grant_kv(call.request_id, call.grant, call.grant_blocks);
      const std::vector<std::uint32_t> mine = grantAnswer(ids, call.grant_blocks);
      std::vector<std::uint32_t> all(mine.size() * static_cast<std::size_t>(comm.size()));
      PD_TRY(comm.allGather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all))));
      continue;
    }
    PD_ASSIGN_OR_RETURN(model::LatentCacheView view, cache(call.geometry));
    std::vector<model::SequenceChunk> batch(call.sequences.size());
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const DecodedSequence& s = call.sequences[i];
      batch[i] = {s.tokens, s.start_pos, s.blocks, s.prev_hidden, s.rope_offset};
    }
    Status status = okStatus();
    if (call.kind == CallKind::ForwardSampled && sampling != nullptr) {
      // The leader samples; this rank only has to take part in the same collectives, so every
      // row is greedy (the cheapest draw) and the tokens are dropped.
      static const SamplingParams greedy{};
      const std::vector<model::RowSample> rows(call.sampled_rows, model::RowSample{&greedy, 0, {}, {}});
      auto out = sampling->forwardSampled(batch, view, call.options, rows);
      if (!out.ok()) status = std::move(out).error();
    } else {
      auto out = call.kind == CallKind::ForwardMtp ? engine.forwardMtp(batch, view, call.options)
                                                   : engine.forward(batch, view, call.options);
      if (!out.ok()) status = std::move(out).error();
    }
    if (!status.ok()) {
      if (isCommunicationError(status.error())) return status;
      log::debug("tp", "rank {}: a call failed as on the leader: {}", comm.rank(), status.error().toString());
    }
  }
}

}  // namespace pd::model
