// UcxTransport's sending side (prefill): a transfer from beginTransfer through its puts (RMA or
// active messages), the flush, the record and the flush behind it, to its one outcome.

#include <algorithm>

#include "pd/common/log.h"
#include "pd/kvtransfer/layout.h"
#include "ucx/ucx_transport_impl.h"

namespace pd::kvtransfer::detail {

Status UcxTransport::beginTransfer(const KvDescriptor& descriptor, Deadline deadline, TransferDoneFn on_done) {
  PD_CHECK(on_done != nullptr);
  return runOnProgressThread([&]() -> Status {
    if (stopping_) return cancelledStatus();
    PD_TRY(checkCompatible(options_.compat, descriptor.compat));
    PD_TRY(validateDescriptor(descriptor));
    // Nothing from the network reaches UCX unchecked: UCX parses addresses and keys without
    // bounds and aborts on some malformed ones (docs/kv-transfer.md, "What reaches UCX").
    for (std::size_t ti = 0; ti < descriptor.targets.size(); ++ti) {
      const KvTarget& target = descriptor.targets[ti];
      if (Status s = blob_check_.checkWorkerAddress(target.worker_address); !s.ok()) {
        return makeError(ErrorCode::InvalidArgument, fmt::format("KV descriptor: target {} (tp rank {}): {}", ti,
                                                                 target.tp_rank, s.error().message));
      }
      for (std::size_t ri = 0; ri < target.regions.size(); ++ri) {
        if (Status s = blob_check_.checkRemoteKey(target.regions[ri].rkey); !s.ok()) {
          return makeError(ErrorCode::InvalidArgument,
                           fmt::format("KV descriptor: target {} region {}: {}", ti, ri, s.error().message));
        }
      }
    }
    const TransferId id = descriptor.transfer_id;
    if (id.empty()) {
      return makeError(ErrorCode::InvalidArgument,
                       "KV descriptor: no transfer id (the decode worker did not grant it)");
    }
    if (transfers_.contains(id)) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("transfer {} is already in flight", id));
    }
    const auto now = Clock::now();
    auto t = std::make_unique<Transfer>();
    t->owner = this;
    t->id = id;
    t->descriptor = descriptor;
    t->started = now;
    t->deadline = std::min(deadline, now + std::chrono::milliseconds(descriptor.timeout_ms));
    t->on_done = std::move(on_done);
    for (const auto& target : descriptor.targets) {
      const std::string key(target.worker_address.begin(), target.worker_address.end());
      if (const auto s = suspects_.find(key); s != suspects_.end() && s->second.first > now) {
        return makeError(ErrorCode::PeerFailed,
                         fmt::format("{} (tp rank {}) is suspect for {} ms more: {}", peerName(key), target.tp_rank,
                                     msUntil(s->second.first, now), s->second.second));
      }
      PD_ASSIGN_OR_RETURN(Peer * peer, connect(key));
      Link link{key, peer, {}};
      for (const auto& region : target.regions) {
        if (data_path_ != KvDataPath::Rma) break;  // active messages need no remote keys
        auto rk = peer->rkeys.find(region.rkey);
        if (rk == peer->rkeys.end()) {
          PD_ASSIGN_OR_RETURN(auto unpacked, ucx::RemoteKey::unpack(peer->ep, region.rkey));
          rk = peer->rkeys.emplace(region.rkey, std::move(unpacked)).first;
        }
        link.rkeys.push_back(rk->second.get());
      }
      t->links.push_back(std::move(link));
    }
    for (auto& link : t->links) link.peer->transfers.insert(id);
    t->am_bytes.assign(t->links.size(), 0);
    metrics_.transferStarted();
    log::debug("kv", "{}: transfer {}: begun to {} targets, {} bytes per target, deadline {} ms", options_.name, id,
               descriptor.targets.size(), requestKvBytes(descriptor), msUntil(t->deadline, now));
    transfers_.emplace(id, std::move(t));
    return okStatus();
  });
}

Status UcxTransport::post(Transfer& t, ucs_status_ptr_t status, std::string_view what) {
  if (UCS_PTR_IS_ERR(status)) {
    const Error e = ucx::ucsError(fmt::format("transfer {}: {}", t.id, what), UCS_PTR_STATUS(status));
    failTransfer(t, e);
    return e;
  }
  if (UCS_PTR_IS_PTR(status)) t.ops.emplace(status, ucx::Request(status));
  return okStatus();
}

Status UcxTransport::put(const TransferId& transfer_id, std::span<const LayerPut> puts) {
  return runOnProgressThread([&]() -> Status {
    if (stopping_) return cancelledStatus();
    const auto it = transfers_.find(transfer_id);
    if (it == transfers_.end()) {
      return makeError(ErrorCode::NotFound, fmt::format("transfer {} is not in flight", transfer_id));
    }
    Transfer& t = *it->second;
    if (t.error) return *t.error;
    if (t.closing_requested) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("transfer {}: put after finish/abort", transfer_id));
    }
    // Plan everything first so that a bad slice posts nothing.
    struct Planned {
      Region* region;
      const LayerPut* put;
      std::vector<std::vector<PlannedPut>> per_target;
    };
    std::vector<Planned> plans;
    const std::uint64_t token_bytes = t.descriptor.compat.tokenBytes();
    for (const auto& lp : puts) {
      const auto r = regions_.find(lp.local_region);
      if (r == regions_.end()) {
        return makeError(ErrorCode::NotFound, fmt::format("no registered region {}", lp.local_region));
      }
      const std::uint64_t bytes = std::uint64_t{lp.slice.num_tokens} * token_bytes;
      if (lp.local_offset > r->second->length || bytes > r->second->length - lp.local_offset) {
        return makeError(ErrorCode::InvalidArgument,
                         fmt::format("transfer {}: {} bytes at offset {} are past local region {} ({} bytes)",
                                     transfer_id, bytes, lp.local_offset, lp.local_region, r->second->length));
      }
      Planned plan{r->second.get(), &lp, {}};
      for (std::size_t ti = 0; ti < t.links.size(); ++ti) {
        PD_ASSIGN_OR_RETURN(auto planned, planLayerPuts(t.descriptor, ti, lp.slice));
        plan.per_target.push_back(std::move(planned));
      }
      plans.push_back(std::move(plan));
    }
    for (const auto& plan : plans) {
      if (t.regions.insert(plan.put->local_region).second) ++plan.region->users;
      const std::byte* source = plan.region->base + plan.put->local_offset;
      for (std::size_t ti = 0; ti < t.links.size(); ++ti) {
        const Link& link = t.links[ti];
        for (const auto& p : plan.per_target[ti]) {
          ucp_request_param_t params{};
          params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
          params.cb.send = &UcxTransport::onOpDone;
          params.user_data = &t;
          params.memh = plan.region->mem.get();
          if (data_path_ == KvDataPath::Rma) {
            const auto st = ucp_put_nbx(link.peer->ep.get(), source + p.local_offset, p.length, p.remote_address,
                                        link.rkeys[p.region_index], &params);
            PD_TRY(post(t, st, "put"));
          } else {
            // Eager: the receiver copies each message as it arrives and never has to fetch it.
            params.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
            params.flags = UCP_AM_SEND_FLAG_EAGER;
            for (std::uint64_t done = 0; done < p.length;) {
              const std::uint64_t n = std::min(kAmChunkBytes, p.length - done);
              const DataHeader& header = t.data_headers.emplace_back(DataHeader{t.id, p.remote_address + done});
              const auto st = ucp_am_send_nbx(link.peer->ep.get(), kDataAmId, &header, sizeof(header),
                                              source + p.local_offset + done, n, &params);
              PD_TRY(post(t, st, "KV data send"));
              done += n;
            }
            t.am_bytes[ti] += p.length;
          }
          metrics_.addBytesPut(p.length);
        }
      }
    }
    return okStatus();
  });
}

void UcxTransport::flushAll(Transfer& t) {
  std::set<Peer*> flushed;
  for (const auto& link : t.links) {
    if (!flushed.insert(link.peer).second) continue;
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    params.cb.send = &UcxTransport::onOpDone;
    params.user_data = &t;
    if (!post(t, ucp_ep_flush_nbx(link.peer->ep.get(), &params), "flush").ok()) return;
  }
}

void UcxTransport::sendRecord(Transfer& t) {
  t.record_headers.clear();
  for (std::size_t ti = 0; ti < t.links.size(); ++ti) {
    RecordHeader& h = t.record_headers.emplace_back(RecordHeader{t.am_bytes[ti], {}});
    if (options_.auth) h.tag = recordTag(*options_.auth, h.data_bytes, t.record_bytes);
  }
  for (std::size_t ti = 0; ti < t.links.size(); ++ti) {
    const Link& link = t.links[ti];
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    params.cb.send = &UcxTransport::onOpDone;
    params.user_data = &t;
    params.flags = UCP_AM_SEND_FLAG_EAGER;
    const auto st = ucp_am_send_nbx(link.peer->ep.get(), kRecordAmId, &t.record_headers[ti], sizeof(RecordHeader),
                                    t.record_bytes.data(), t.record_bytes.size(), &params);
    if (!post(t, st, "record send").ok()) return;
    metrics_.recordSent();
  }
  // A second flush: success is reported only once the record's send is flushed to the peer.
  flushAll(t);
}

Status UcxTransport::finish(CompletionRecord record) {
  return runOnProgressThread([&]() -> Status {
    if (stopping_) return cancelledStatus();
    const auto it = transfers_.find(record.transfer_id);
    if (it == transfers_.end()) {
      return makeError(ErrorCode::NotFound, fmt::format("transfer {} is not in flight", record.transfer_id));
    }
    Transfer& t = *it->second;
    if (t.error) return *t.error;
    if (t.closing_requested) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("transfer {}: finished twice", record.transfer_id));
    }
    record.compat_hash = compat_hash_;
    t.record_bytes = encode(record);
    t.closing_requested = true;
    t.final_status = okStatus();
    advance(t);
    return okStatus();
  });
}

Status UcxTransport::abort(const TransferId& transfer_id, ErrorCode code, std::string reason) {
  return runOnProgressThread([&]() -> Status {
    const auto it = transfers_.find(transfer_id);
    if (it == transfers_.end()) {
      return makeError(ErrorCode::NotFound, fmt::format("transfer {} is not in flight", transfer_id));
    }
    Transfer& t = *it->second;
    const Error cancelled =
        makeError(ErrorCode::Cancelled, fmt::format("transfer {} aborted: {}", transfer_id, reason));
    if (t.error || t.closing_requested || stopping_) {
      failTransfer(t, cancelled);
      advance(t);
      return okStatus();
    }
    // The failure record goes out after a flush, like a completion record, so that the
    // receiver may reuse the blocks as soon as it reads it.
    t.record_bytes = encode(FailureRecord{transfer_id, compat_hash_, code, std::move(reason)});
    t.closing_requested = true;
    t.final_status = cancelled;
    advance(t);
    return okStatus();
  });
}

void UcxTransport::failTransfer(Transfer& t, Error error) {
  if (!t.error) {
    log::warn("kv", "{}: transfer {}: {}", options_.name, t.id, error.message);
    t.error = std::move(error);
  }
  dirty_.insert(t.id);
}

void UcxTransport::advance(Transfer& t) {
  if (t.error) {
    if (t.ops.empty()) finalize(t.id, *t.error);
    return;
  }
  if (!t.closing_requested) return;
  // Posting -> Flushing: the flush is posted behind the puts at once; it completes when they are
  // remotely complete. Flushing -> Recording once everything completed: the record (then a
  // second flush) goes out. Recording -> done once those completed too.
  if (t.stage == Stage::Posting) {
    t.stage = Stage::Flushing;
    flushAll(t);
  }
  if (t.error || !t.ops.empty()) return;
  if (t.stage == Stage::Flushing) {
    t.stage = Stage::Recording;
    sendRecord(t);
  }
  if (t.error || !t.ops.empty()) return;
  finalize(t.id, t.final_status);
}

void UcxTransport::advanceDirty() {
  while (!dirty_.empty()) {
    const TransferId id = *dirty_.begin();
    dirty_.erase(dirty_.begin());
    const auto it = transfers_.find(id);
    if (it != transfers_.end()) advance(*it->second);
  }
}

void UcxTransport::finalize(const TransferId& id, Status status) {
  auto node = transfers_.extract(id);
  if (node.empty()) return;
  Transfer& t = *node.mapped();
  PD_CHECK(t.ops.empty());
  for (const RegionId r : t.regions) {
    if (const auto it = regions_.find(r); it != regions_.end()) --it->second->users;
  }
  for (const auto& link : t.links) {
    if (const auto it = peers_.find(link.key); it != peers_.end() && it->second.get() == link.peer) {
      it->second->transfers.erase(id);
    }
  }
  if (status.ok()) {
    metrics_.transferSucceeded(Clock::now() - t.started);
    log::debug("kv", "{}: transfer {}: complete", options_.name, id);
  } else {
    metrics_.transferFailed(status.error().code);
  }
  t.on_done(id, std::move(status));
}

void UcxTransport::onOpDone(void* request, ucs_status_t status, void* user_data) {
  auto* t = static_cast<Transfer*>(user_data);
  if (status != UCS_OK && !t->error) {
    t->error = ucx::ucsError(fmt::format("KV transfer {} to the peer failed", t->id), status);
  }
  t->owner->dirty_.insert(t->id);
  t->ops.erase(request);  // frees the request
}

}  // namespace pd::kvtransfer::detail
