#pragma once
// Structural checks of the two UCX blobs a KV descriptor carries from the network: a decode
// rank's packed worker address (ucp_ep_create's input) and its packed remote keys
// (ucp_ep_rkey_unpack's input). Neither UCX call takes a length, and UCX 1.13 asserts (aborting
// the process) on an address header it does not know, so hostile bytes must be stopped here.
//
// The checks compare a peer's blob with this process's own, packed by the same UCX build and
// configuration (docs/kv-transfer.md, "What reaches UCX"):
//  - worker address: the same header (format version and flags), a walk of the whole device /
//    interface list that stays inside the buffer and ends exactly at its end, every length
//    field within bounds, interface attributes in range (UCX asserts on a NaN or negative
//    overhead), a transport this process also has (by UCX's name checksum) claiming the same
//    capabilities as here, and no endpoint addresses (a worker address never has them);
//  - remote key: the same memory type, MDs among this process's own, each MD's packed key of the
//    size this process packs for that MD, and nothing after the last one.
// The walk follows the UCX 1.13 address formats (v1 and v2, non-unified mode); create()
// calibrates it on this process's own address and refuses a UCX whose address it cannot walk,
// so an unknown format fails closed at startup instead of letting bytes through.
//
// Thread rules: immutable after create(); thread-safe. No UCX calls: pure byte checks.

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <vector>

#include "pd/common/result.h"

namespace pd::kvtransfer::ucx {

/// Per UCX transport (name checksum): the capability flags its interfaces pack.
using TransportFlags = std::map<std::uint16_t, std::set<std::uint32_t>>;

class UcxBlobCheck {
 public:
  /// Learns the shape of this process's blobs. Unsupported when `own_address` or `own_rkey`
  /// is not a format the checks understand.
  [[nodiscard]] static Result<UcxBlobCheck> create(std::span<const std::uint8_t> own_address,
                                                   std::span<const std::uint8_t> own_rkey);

  /// Ok when `address` may be given to ucp_ep_create; InvalidArgument naming the first problem.
  [[nodiscard]] Status checkWorkerAddress(std::span<const std::uint8_t> address) const;
  /// Ok when `rkey` may be given to ucp_ep_rkey_unpack; InvalidArgument naming the problem.
  [[nodiscard]] Status checkRemoteKey(std::span<const std::uint8_t> rkey) const;

 private:
  struct AddressShape {
    std::vector<std::uint8_t> header;  // 1 byte (v1) or 2 (v2)
    std::size_t attr_bytes = 0;        // packed interface attributes per interface
    TransportFlags transports;
  };
  struct RkeyShape {
    std::uint64_t md_map = 0;
    std::uint8_t mem_type = 0;
    std::vector<std::uint8_t> md_key_bytes;  // indexed by MD index, for MDs in md_map
  };
  UcxBlobCheck(AddressShape address, RkeyShape rkey) : address_(std::move(address)), rkey_(std::move(rkey)) {}

  AddressShape address_;
  RkeyShape rkey_;
};

}  // namespace pd::kvtransfer::ucx
