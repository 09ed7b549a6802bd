// UcxTransport's peers: one endpoint per peer worker address (cached, with the remote keys
// unpacked on it), the connect probe, peer failure and the suspect list.

#include <algorithm>

#include "pd/common/log.h"
#include "ucx/ucx_transport_impl.h"

namespace pd::kvtransfer::detail {

std::string peerName(const std::string& key) {
  // Worker addresses are binary; a short hash names the peer in logs and errors.
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : key) {
    h ^= static_cast<std::uint8_t>(c);
    h *= 0x100000001b3ULL;
  }
  return fmt::format("peer-{:08x}", static_cast<std::uint32_t>(h ^ (h >> 32)));
}

Result<UcxTransport::Peer*> UcxTransport::connect(const std::string& key) {
  if (const auto it = peers_.find(key); it != peers_.end()) return it->second.get();
  auto peer = std::make_unique<Peer>();
  peer->owner = this;
  peer->key = key;
  peer->name = peerName(key);
  const std::span<const std::uint8_t> address(reinterpret_cast<const std::uint8_t*>(key.data()), key.size());
  Result<ucx::Endpoint> ep = ucx::Endpoint::create(worker_, address, &UcxTransport::onPeerError, peer.get());
  if (!ep.ok()) {
    // Avoid the peer for a while, as one that missed a deadline: UCX 1.13's tcp connect blocks
    // this thread until the kernel gives up (a link that went silent: ~3 s of ARP per attempt),
    // and retrying it for every new transfer would stall every transfer and every caller.
    suspects_[key] = {Clock::now() + options_.peer_suspect_time, ep.error().message};
    log::warn("kv", "{}: cannot connect to {}: {} (marked suspect)", options_.name, peer->name, ep.error().message);
    updatePeerGauges();
    return std::move(ep).error();
  }
  peer->ep = std::move(ep).value();
  peer->connect_deadline = Clock::now() + options_.connect_timeout;
  // A flush completes after the endpoint's wireup round trip: our connect confirmation.
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  params.cb.send = &UcxTransport::onProbeDone;
  params.user_data = peer.get();
  const ucs_status_ptr_t probe = ucp_ep_flush_nbx(peer->ep.get(), &params);
  if (UCS_PTR_IS_ERR(probe)) return ucx::ucsError(fmt::format("connecting to {}", peer->name), UCS_PTR_STATUS(probe));
  if (UCS_PTR_IS_PTR(probe)) {
    peer->probe = ucx::Request(probe);
  } else {
    peer->connected = true;
  }
  log::debug("kv", "{}: connecting to {}", options_.name, peer->name);
  Peer* raw = peer.get();
  peers_.emplace(key, std::move(peer));
  updatePeerGauges();
  return raw;
}

void UcxTransport::failPeer(const std::string& key, const Error& error, bool suspect) {
  const auto it = peers_.find(key);
  if (it == peers_.end()) return;
  std::unique_ptr<Peer> peer = std::move(it->second);
  peers_.erase(it);
  if (peer->transfers.empty() && !suspect) {
    log::info("kv", "{}: {} (no transfer in flight; endpoint dropped)", options_.name, error.message);
  } else {
    log::warn("kv", "{}: {}{}", options_.name, error.message, suspect ? " (marked suspect)" : "");
  }
  for (const TransferId& id : peer->transfers) {
    if (const auto t = transfers_.find(id); t != transfers_.end()) failTransfer(*t->second, error);
  }
  // Force close completes every request on the endpoint (callbacks may run inside this call),
  // which lets the transfers above finish failing.
  ClosingPeer closing{nullptr, peer->ep.close(/*force=*/true), Clock::now()};
  peer->probe = ucx::Request{};
  peer->rkeys.clear();
  // No callback names this peer any more; forget reports queued for it.
  std::erase_if(failed_peers_, [&](const auto& failed) { return failed.first == peer.get(); });
  closing.peer = std::move(peer);
  closing_.push_back(std::move(closing));
  if (suspect) suspects_[key] = {Clock::now() + options_.peer_suspect_time, error.message};
  updatePeerGauges();
}

void UcxTransport::onProbeDone(void* /*request*/, ucs_status_t status, void* user_data) {
  auto* peer = static_cast<Peer*>(user_data);
  if (status == UCS_OK) {
    peer->connected = true;
    peer->owner->updatePeerGauges();
  } else {
    peer->owner->failed_peers_.emplace_back(peer, status);
  }
  peer->probe = ucx::Request{};  // frees the request
}

void UcxTransport::onPeerError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  peer->owner->failed_peers_.emplace_back(peer, status);
}

}  // namespace pd::kvtransfer::detail
