// UcxTransport's receiving side (decode): expectations and their grants, KV data copied from
// active messages after its checks, records held until their data arrived, delivery.

#include <algorithm>
#include <cstring>
#include <variant>

#include "pd/common/log.h"
#include "pd/kvtransfer/layout.h"
#include "ucx/ucx_transport_impl.h"

namespace pd::kvtransfer::detail {

Status UcxTransport::expect(std::uint64_t request_id, Deadline deadline, ArrivalFn on_arrival) {
  PD_CHECK(on_arrival != nullptr);
  return runOnProgressThread([&]() -> Status {
    if (stopping_) return cancelledStatus();
    if (expectations_.contains(request_id)) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already expected", request_id));
    }
    expectations_.emplace(request_id, Expectation{deadline, Clock::now(), std::move(on_arrival)});
    metrics_.receiveExpected();
    return okStatus();
  });
}

bool UcxTransport::cancelExpect(std::uint64_t request_id) {
  return runOnProgressThread([&]() -> bool {
    auto node = expectations_.extract(request_id);
    if (node.empty()) return false;
    metrics_.receiveFailed(ErrorCode::Cancelled);
    node.mapped().on_arrival(
        request_id, makeError(ErrorCode::Cancelled, fmt::format("receive of request {} cancelled", request_id)));
    if (node.mapped().grant) releaseGrantId(node.mapped().grant->id);
    return true;
  });
}

Result<KvDescriptor> UcxTransport::grant(std::uint64_t request_id, KvDescriptor descriptor) {
  return runOnProgressThread([&]() -> Result<KvDescriptor> {
    if (stopping_) return cancelledStatus().error();
    const std::uint64_t id = request_id;
    const auto it = expectations_.find(id);
    if (it == expectations_.end()) {
      return makeError(ErrorCode::NotFound, fmt::format("request {} is not expected", id));
    }
    PD_TRY(validateDescriptor(descriptor));
    const auto target = std::find_if(descriptor.targets.begin(), descriptor.targets.end(),
                                     [&](const KvTarget& t) { return t.worker_address == address_; });
    if (target == descriptor.targets.end()) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("request {}: the descriptor lists no target at this transport's address", id));
    }
    const CompatInfo& c = descriptor.compat;
    Grant g;
    // A descriptor another rank's transport granted first keeps its id: one id per descriptor.
    g.id = descriptor.transfer_id.empty() ? TransferId::random() : descriptor.transfer_id;
    if (it->second.grant && it->second.grant->id != g.id) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("request {} is already granted as transfer {}", id, it->second.grant->id));
    }
    if (const auto bound = granted_ids_.find(g.id); bound != granted_ids_.end() && bound->second != id) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("request {}: transfer {} is already bound to another request", id, g.id));
    }
    g.num_tokens = descriptor.num_tokens;
    g.block_bytes = std::uint64_t{c.block_size} * c.tokenBytes();
    g.regions = target->regions;
    for (auto& r : g.regions) r.rkey.clear();
    const std::uint64_t blocks = (std::uint64_t{descriptor.num_tokens} + c.block_size - 1) / c.block_size;
    // Present blocks (the prefix cache's, shared and read-only) are not granted: data for them
    // is outside the request's writable blocks and fails the receive like any other stray write.
    const std::uint64_t present = descriptor.present_tokens / c.block_size;
    // This rank's own block ids where it lists them (a staging rank's staging blocks).
    // (validateDescriptor above checked that the list covers the tokens.)
    const std::vector<std::uint32_t>& ids = targetBlockIds(descriptor, *target);
    g.blocks.insert(ids.begin() + static_cast<std::ptrdiff_t>(present),
                    ids.begin() + static_cast<std::ptrdiff_t>(blocks));
    descriptor.transfer_id = g.id;
    granted_ids_[g.id] = id;
    it->second.grant = std::move(g);
    return descriptor;
  });
}

bool UcxTransport::Grant::covers(std::uint64_t address, std::uint64_t length) const {
  // Piece by piece (a message may span consecutive blocks): each piece must lie in one granted
  // block of some layer of a granted region. Layouts validated by validateDescriptor never
  // overlap, so the first match is the only one.
  while (length > 0) {
    std::uint64_t piece = 0;
    for (const KvRegion& r : regions) {
      if (address < r.base_address || address - r.base_address >= r.length) continue;
      const std::uint64_t offset = address - r.base_address;
      for (std::uint64_t l = 0; l < r.num_layers && piece == 0; ++l) {
        if (r.layer_stride != 0 && l > offset / r.layer_stride) break;
        if (r.layer_stride == 0 && l > 0) break;
        const std::uint64_t in_layer = offset - l * r.layer_stride;
        const std::uint64_t block = in_layer / r.block_stride;
        const std::uint64_t within = in_layer % r.block_stride;
        if (within < block_bytes && block <= UINT32_MAX && blocks.contains(static_cast<std::uint32_t>(block))) {
          piece = std::min(length, block_bytes - within);
        }
      }
      if (piece != 0) break;
    }
    if (piece == 0) return false;
    address += piece;
    length -= piece;
  }
  return true;
}

std::pair<std::uint64_t, UcxTransport::Expectation*> UcxTransport::grantedRequest(const TransferId& id) {
  const auto bound = granted_ids_.find(id);
  if (bound == granted_ids_.end()) return {0, nullptr};
  const auto it = expectations_.find(bound->second);
  if (it == expectations_.end() || !it->second.grant || it->second.grant->id != id) return {0, nullptr};
  return {it->first, &it->second};
}

void UcxTransport::releaseGrantId(const TransferId& id) {
  const auto bound = granted_ids_.find(id);
  if (bound == granted_ids_.end()) return;
  const auto it = expectations_.find(bound->second);
  // Kept while an expectation of the request (a re-armed one keeps the grant) still holds it.
  if (it != expectations_.end() && it->second.grant && it->second.grant->id == id) return;
  granted_ids_.erase(bound);
}

void UcxTransport::handleInbox() {
  while (!inbox_.empty()) {
    auto batch = std::move(inbox_);
    inbox_.clear();
    for (auto& record : batch) deliverRecord(std::move(record));
  }
  deliverHeld();
}

void UcxTransport::deliverRecord(InboxRecord record) {
  metrics_.recordReceived();
  auto decoded = decodeRecord(record.bytes);
  if (!decoded.ok()) {
    metrics_.recordRejected();
    log::warn("kv", "{}: dropped a record: {}", options_.name, decoded.error().message);
    return;
  }
  const bool is_completion = std::holds_alternative<CompletionRecord>(decoded.value());
  if (is_completion && std::get<CompletionRecord>(decoded.value()).traceparent_dropped) {
    metrics_.recordTraceDropped();  // advisory: the record goes on without its trace context
  }
  const TransferId transfer_id = is_completion ? std::get<CompletionRecord>(decoded.value()).transfer_id
                                               : std::get<FailureRecord>(decoded.value()).transfer_id;
  const std::uint64_t hash = is_completion ? std::get<CompletionRecord>(decoded.value()).compat_hash
                                           : std::get<FailureRecord>(decoded.value()).compat_hash;
  // Only the 128-bit wire id names a request: one no live grant holds (guessed, stale, expired
  // or cancelled) is dropped and counted, and the request it may resemble goes on untouched.
  const auto [id, expectation] = grantedRequest(transfer_id);
  if (expectation == nullptr || expectation->held_record) {
    metrics_.recordRejected();
    log::warn("kv", "{}: dropped a record for transfer {}, which is not granted here (unknown, late or duplicate)",
              options_.name, transfer_id);
    return;
  }
  const auto it = expectations_.find(id);
  const std::optional<Grant>& granted = it->second.grant;
  if (options_.auth) {
    const crypto::Digest expected = recordTag(*options_.auth, record.data_bytes, record.bytes);
    if (!crypto::constantTimeEqual(expected, record.tag)) {
      metrics_.recordRejected();
      metrics_.recordUnauthenticated();
      const bool unsigned_record = record.tag == crypto::Digest{};
      // It carries the request's transfer id, so it comes from the descriptor's holder, which
      // is not a holder of the cluster secret (or has another one): the transfer cannot succeed,
      // fail it now rather than at its deadline.
      auto node = expectations_.extract(it);
      failReceive(id, std::move(node.mapped()),
                  makeError(ErrorCode::Unauthenticated,
                            fmt::format("KV receive of request {}: the {} record is {}", id,
                                        is_completion ? "completion" : "failure",
                                        unsigned_record ? "not signed with the cluster secret"
                                                        : "signed with another secret or altered")));
      return;
    }
  }
  if (is_completion && std::get<CompletionRecord>(decoded.value()).num_tokens != granted->num_tokens) {
    auto node = expectations_.extract(it);
    const std::uint32_t holds = node.mapped().grant->num_tokens;
    failReceive(
        id, std::move(node.mapped()),
        makeError(ErrorCode::Corrupt, fmt::format("KV receive of request {}: the completion record claims {} "
                                                  "tokens, the request holds blocks for {}",
                                                  id, std::get<CompletionRecord>(decoded.value()).num_tokens, holds)));
    return;
  }
  if (hash == compat_hash_ && is_completion && record.data_bytes > it->second.bytes_received) {
    // Active messages may overtake each other: wait for the rest of the data (or the deadline).
    it->second.held_record = std::move(std::get<CompletionRecord>(decoded.value()));
    it->second.record_data_bytes = record.data_bytes;
    return;
  }
  auto node = expectations_.extract(it);
  if (hash != compat_hash_) {
    failReceive(id, std::move(node.mapped()),
                makeError(ErrorCode::Unsupported,
                          fmt::format("record of request {} carries compatibility hash {:016x}, ours is {:016x}", id,
                                      hash, compat_hash_)));
    return;
  }
  if (is_completion) {
    metrics_.receiveSucceeded(Clock::now() - node.mapped().started);
    node.mapped().on_arrival(id, std::move(std::get<CompletionRecord>(decoded.value())));
    releaseGrantId(transfer_id);
  } else {
    auto& failure = std::get<FailureRecord>(decoded.value());
    // A retry's data may overtake this record (data is copied at once, records wait for this
    // pass): bytes beyond the failed sender's count go to the expectation that on_arrival may
    // re-arm for the same request (decode's prefill retries, docs/internal-api.md).
    const std::uint64_t early =
        node.mapped().bytes_received > record.data_bytes ? node.mapped().bytes_received - record.data_bytes : 0;
    failReceive(id, std::move(node.mapped()),
                makeError(failure.code, fmt::format("prefill side failed request {}: {}", id, failure.message)), early);
  }
}

void UcxTransport::failReceive(std::uint64_t id, Expectation expectation, Error error, std::uint64_t early) {
  metrics_.receiveFailed(error.code);
  expectation.on_arrival(id, std::move(error));
  if (const auto again = expectations_.find(id); again != expectations_.end()) {
    again->second.bytes_received += early;
    // The re-armed receive waits for a retry of the same descriptor: the same grant holds, so a
    // failed attempt never opens the request's pool to writes outside its blocks.
    if (!again->second.grant) again->second.grant = expectation.grant;
  }
  if (expectation.grant) releaseGrantId(expectation.grant->id);
}

void UcxTransport::deliverHeld() {
  while (!data_complete_.empty()) {
    const std::uint64_t id = *data_complete_.begin();
    data_complete_.erase(data_complete_.begin());
    auto node = expectations_.extract(id);
    if (node.empty()) continue;
    Expectation& e = node.mapped();
    if (e.data_error) {
      const std::string why = *e.data_error;
      failReceive(id, std::move(e),
                  makeError(ErrorCode::Corrupt, fmt::format("KV receive of request {}: {}", id, why)));
    } else if (e.held_record && e.bytes_received >= e.record_data_bytes) {
      metrics_.receiveSucceeded(Clock::now() - e.started);
      e.on_arrival(id, std::move(*e.held_record));
      if (e.grant) releaseGrantId(e.grant->id);
    } else {
      expectations_.insert(std::move(node));  // not complete after all
    }
  }
}

ucs_status_t UcxTransport::onRecord(void* arg, const void* header, std::size_t header_length, void* data,
                                    std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  if (header_length != sizeof(RecordHeader)) {
    self->metrics_.recordRejected();
    log::warn("kv", "{}: dropped a record with a {}-byte header", self->options_.name, header_length);
    return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ? UCS_ERR_UNSUPPORTED : UCS_OK;
  }
  RecordHeader framing{};
  std::memcpy(&framing, header, sizeof(framing));
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    const auto* bytes = static_cast<const std::uint8_t*>(data);
    self->inbox_.push_back(
        InboxRecord{std::vector<std::uint8_t>(bytes, bytes + length), framing.data_bytes, framing.tag});
    return UCS_OK;
  }
  if (length > kMaxRecordBytes) {
    self->metrics_.recordRejected();
    log::warn("kv", "{}: dropped a {}-byte record (limit {})", self->options_.name, length, kMaxRecordBytes);
    return UCS_ERR_MESSAGE_TRUNCATED;
  }
  auto pending = std::make_unique<PendingRecv>();
  pending->owner = self;
  pending->data_bytes = framing.data_bytes;
  pending->tag = framing.tag;
  pending->bytes.resize(length);
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  params.cb.recv_am = &UcxTransport::onRecvDataDone;
  params.user_data = pending.get();
  const auto st = ucp_am_recv_data_nbx(self->worker_.get(), data, pending->bytes.data(), length, &params);
  if (UCS_PTR_IS_ERR(st)) {
    self->metrics_.recordRejected();
    log::warn("kv", "{}: receiving a record: {}", self->options_.name, ucs_status_string(UCS_PTR_STATUS(st)));
    return UCS_OK;
  }
  if (st == nullptr) {
    self->inbox_.push_back(InboxRecord{std::move(pending->bytes), pending->data_bytes, pending->tag});
  } else {
    pending->request = ucx::Request(st);
    self->pending_recvs_.push_back(std::move(pending));
  }
  return UCS_INPROGRESS;
}

ucs_status_t UcxTransport::onData(void* arg, const void* header, std::size_t header_length, void* data,
                                  std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    // Our senders always send KV data eagerly; refusing fails the sender's send.
    self->metrics_.addBytesDropped(length);
    return UCS_ERR_UNSUPPORTED;
  }
  if (header_length != sizeof(DataHeader)) {
    self->metrics_.addBytesDropped(length);
    log::warn("kv", "{}: dropped KV data with a {}-byte header", self->options_.name, header_length);
    return UCS_OK;
  }
  DataHeader h{};
  std::memcpy(&h, header, sizeof(h));
  const auto [request_id, expectation] = self->grantedRequest(h.transfer_id);
  if (expectation == nullptr) {
    // Not a live grant's id: guessed, stale (expired or cancelled: its blocks may belong to
    // another request by now) or never granted. Dropped and counted; no receive fails (failing
    // one would let anyone who guesses an id end someone else's request).
    self->metrics_.addBytesDropped(length);
    log::debug("kv", "{}: dropped {} bytes of KV data for transfer {}, which is not granted here", self->options_.name,
               length, h.transfer_id);
    return UCS_OK;
  }
  Expectation& e = *expectation;
  std::byte* destination = nullptr;
  for (const auto& [id, region] : self->regions_) {
    const auto base = reinterpret_cast<std::uint64_t>(region->base);
    if (h.remote_address >= base && h.remote_address - base <= region->length &&
        length <= region->length - (h.remote_address - base)) {
      destination = region->base + (h.remote_address - base);
      break;
    }
  }
  if (destination == nullptr || !e.grant->covers(h.remote_address, length)) {
    self->metrics_.addBytesDropped(length);
    if (!e.data_error) {
      e.data_error = fmt::format("{} bytes for address 0x{:x} lie outside {}", length, h.remote_address,
                                 destination == nullptr ? "every registered region" : "the blocks the request holds");
    }
    self->data_complete_.insert(request_id);
    return UCS_OK;
  }
  std::memcpy(destination, data, length);
  e.bytes_received += length;
  self->metrics_.addBytesReceived(length);
  if (e.held_record && e.bytes_received >= e.record_data_bytes) self->data_complete_.insert(request_id);
  return UCS_OK;
}

void UcxTransport::onRecvDataDone(void* /*request*/, ucs_status_t status, std::size_t /*length*/, void* user_data) {
  auto* pending = static_cast<PendingRecv*>(user_data);
  pending->done = true;
  pending->status = status;
  pending->request = ucx::Request{};  // frees the request
}

}  // namespace pd::kvtransfer::detail
