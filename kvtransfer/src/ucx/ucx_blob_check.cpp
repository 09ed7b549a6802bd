#include "ucx/ucx_blob_check.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

namespace pd::kvtransfer::ucx {
namespace {

// UCX 1.13 packed worker address (src/ucp/wireup/address.c): a header (v1: version in the low
// nibble, flags in the high one; v2: version byte, flags byte), optional uuid / client id /
// name, then devices, each with its interfaces. Only the field layout is mirrored here.
constexpr std::uint8_t kVersionMask = 0x0f;
constexpr std::uint8_t kVersionV1 = 0;
constexpr std::uint8_t kVersionV2 = 1;
constexpr std::uint8_t kHeaderDebugInfo = 0x01;
constexpr std::uint8_t kHeaderWorkerUuid = 0x02;
constexpr std::uint8_t kHeaderClientId = 0x04;
constexpr std::uint8_t kNullResource = 0xff;
constexpr std::uint8_t kFlagLast = 0x80;
constexpr std::uint8_t kFlagHasEpAddress = 0x40;  // interface length byte
constexpr std::uint8_t kFlagNumPaths = 0x40;      // device length byte
constexpr std::uint8_t kFlagSysDevice = 0x20;     // device length byte
constexpr std::uint8_t kMdEmptyDevice = 0x80;
constexpr std::uint8_t kMdIndexMaskV1 = 0x1f;
constexpr std::uint8_t kMdIndexMaskV2 = 0x7f;
constexpr std::uint8_t kDeviceLengthMask = 0x1f;
constexpr std::uint8_t kInterfaceLengthMask = 0x3f;
/// Packed interface attributes: v1 16 bytes, v2 8, each optionally followed by a resource index.
constexpr std::array<std::size_t, 2> kAttrBytesV1{16, 17};
constexpr std::array<std::size_t, 2> kAttrBytesV2{8, 9};
/// Far above UCX's own limits (64 resources, a few devices per host).
constexpr std::size_t kMaxDevices = 128;
constexpr std::size_t kMaxInterfaces = 128;

// Packed remote key (src/ucp/core/ucp_rkey.c): u64 MD map, u8 memory type, then for each MD in
// the map (ascending) a u8 size and that many bytes of the MD's own key.
constexpr std::size_t kRkeyHeaderBytes = 9;

std::string hex(std::span<const std::uint8_t> bytes) {
  if (bytes.empty()) return "(none)";
  std::string out = "0x";
  for (const auto b : bytes) out += fmt::format("{:02x}", b);
  return out;
}

Error bad(std::string_view what, std::string detail) {
  return makeError(ErrorCode::InvalidArgument, fmt::format("{}: {}", what, detail));
}

/// A bounds-checked forward reader; the first failed read leaves it failed.
class Cursor {
 public:
  explicit Cursor(std::span<const std::uint8_t> bytes) : bytes_(bytes) {}
  std::optional<std::uint8_t> byte() {
    if (pos_ >= bytes_.size()) return std::nullopt;
    return bytes_[pos_++];
  }
  std::optional<std::uint8_t> peek() const {
    if (pos_ >= bytes_.size()) return std::nullopt;
    return bytes_[pos_];
  }
  std::optional<std::uint16_t> u16() {
    if (bytes_.size() - pos_ < 2) return std::nullopt;
    std::uint16_t v = 0;
    std::memcpy(&v, bytes_.data() + pos_, 2);
    pos_ += 2;
    return v;
  }
  bool skip(std::size_t n) {
    if (bytes_.size() - pos_ < n) return false;
    pos_ += n;
    return true;
  }
  [[nodiscard]] std::size_t pos() const { return pos_; }
  [[nodiscard]] std::size_t left() const { return bytes_.size() - pos_; }

 private:
  std::span<const std::uint8_t> bytes_;
  std::size_t pos_ = 0;
};

/// Checks one interface's packed attributes and returns its capability flags. UCX uses the v1
/// floats in its transport scoring without checking them (a NaN or negative overhead trips an
/// assertion there); v2 packs them as 8-bit codes, which are always in range.
Result<std::uint32_t> interfaceFlags(std::span<const std::uint8_t> attr, bool v2) {
  if (v2) {
    std::uint16_t flags = 0;
    std::memcpy(&flags, attr.data() + 6, sizeof(flags));
    return flags;
  }
  std::array<float, 3> values{};  // overhead (s), bandwidth (B/s), latency overhead (s)
  std::memcpy(values.data(), attr.data(), sizeof(values));
  const auto in = [](float v, float low, float high) { return std::isfinite(v) && v >= low && v <= high; };
  if (!in(values[0], 0.0F, 1.0F) || !in(values[1], 1.0F, 1e15F) || !in(values[2], 0.0F, 1.0F)) {
    return bad("UCX worker address",
               fmt::format("interface attributes out of range (overhead {}, bandwidth {}, latency {})", values[0],
                           values[1], values[2]));
  }
  std::uint32_t prio_cap_flags = 0;
  std::memcpy(&prio_cap_flags, attr.data() + 12, sizeof(prio_cap_flags));
  return prio_cap_flags & ~0xffU;  // the low byte is the priority
}

struct AddressWalk {
  std::vector<std::uint8_t> header;
  TransportFlags transports;
};

/// Walks a packed worker address. `allowed` (when not null) holds the capability flags each of
/// this process's transports packs; an interface of one of them must pack the same.
Result<AddressWalk> walkAddress(std::span<const std::uint8_t> bytes, std::size_t attr_bytes,
                                const TransportFlags* allowed) {
  constexpr std::string_view kWhat = "UCX worker address";
  const auto truncated = [&](std::string_view field, const Cursor& c) {
    return bad(kWhat, fmt::format("truncated in {} at byte {} of {}", field, c.pos(), bytes.size()));
  };
  if (bytes.empty()) return bad(kWhat, "empty");
  AddressWalk walk;
  Cursor c(bytes);
  const std::uint8_t first = *c.byte();
  const std::uint8_t version = first & kVersionMask;
  std::uint8_t flags = 0;
  if (version == kVersionV1) {
    flags = static_cast<std::uint8_t>(first >> 4U);
    walk.header = {first};
  } else if (version == kVersionV2) {
    const auto f = c.byte();
    if (!f) return truncated("the header", c);
    flags = *f;
    walk.header = {first, flags};
  } else {
    return bad(kWhat, fmt::format("unknown format version {} (header byte 0x{:02x})", version, first));
  }
  const bool v2 = version == kVersionV2;
  // An extended length: the masked value, or the next byte when the value is all ones (v2).
  const auto extended = [&](std::uint8_t value, std::uint8_t mask) -> std::optional<std::uint8_t> {
    if (v2 && (value & mask) == mask) return c.byte();
    return static_cast<std::uint8_t>(value & mask);
  };
  if ((flags & kHeaderWorkerUuid) != 0 && !c.skip(8)) return truncated("the worker uuid", c);
  if ((flags & kHeaderClientId) != 0 && !c.skip(8)) return truncated("the client id", c);
  if ((flags & kHeaderDebugInfo) != 0) {
    const auto n = c.byte();
    if (!n || !c.skip(*n)) return truncated("the worker name", c);
  }
  if (c.peek() == kNullResource) return bad(kWhat, "lists no transports");
  std::size_t devices = 0;
  std::size_t interfaces = 0;
  for (bool last_device = false; !last_device;) {
    if (++devices > kMaxDevices) return bad(kWhat, fmt::format("more than {} devices", kMaxDevices));
    const auto md = c.byte();
    if (!md) return truncated("a device", c);
    const bool empty_device = (*md & kMdEmptyDevice) != 0;
    if (!extended(*md, v2 ? kMdIndexMaskV2 : kMdIndexMaskV1)) return truncated("a memory domain index", c);
    const auto length_byte = c.byte();
    if (!length_byte) return truncated("a device", c);
    last_device = (*length_byte & kFlagLast) != 0;
    const auto device_length = extended(*length_byte, kDeviceLengthMask);
    if (!device_length) return truncated("a device address length", c);
    if ((*length_byte & kFlagNumPaths) != 0 && !c.skip(1)) return truncated("a device's path count", c);
    if ((*length_byte & kFlagSysDevice) != 0 && !c.skip(1)) return truncated("a device's system id", c);
    if (!c.skip(*device_length)) return truncated("a device address", c);
    for (bool last_interface = empty_device; !last_interface;) {
      if (++interfaces > kMaxInterfaces) return bad(kWhat, fmt::format("more than {} interfaces", kMaxInterfaces));
      const auto transport = c.u16();
      if (!transport) return truncated("an interface", c);
      const std::size_t attr_at = c.pos();
      if (!c.skip(attr_bytes)) return truncated("interface attributes", c);
      PD_ASSIGN_OR_RETURN(const std::uint32_t caps, interfaceFlags(bytes.subspan(attr_at, attr_bytes), v2));
      // A transport this UCX lacks is never selected; one it has must claim what it can do here.
      if (allowed != nullptr) {
        if (const auto it = allowed->find(*transport); it != allowed->end() && !it->second.contains(caps)) {
          return bad(kWhat, fmt::format("transport 0x{:04x} claims capabilities 0x{:x}, which it does not have here",
                                        *transport, caps));
        }
      }
      walk.transports[*transport].insert(caps);
      const auto interface_byte = c.byte();
      if (!interface_byte) return truncated("an interface", c);
      if ((*interface_byte & kFlagHasEpAddress) != 0) return bad(kWhat, "carries endpoint addresses");
      last_interface = (*interface_byte & kFlagLast) != 0;
      const auto interface_length = extended(*interface_byte, kInterfaceLengthMask);
      if (!interface_length) return truncated("an interface address length", c);
      if (!c.skip(*interface_length)) return truncated("an interface address", c);
    }
  }
  if (c.left() != 0) return bad(kWhat, fmt::format("{} bytes after the last device", c.left()));
  return walk;
}

struct RkeyWalk {
  std::uint64_t md_map = 0;
  std::uint8_t mem_type = 0;
  std::vector<std::uint8_t> md_key_bytes;  // by MD index
};

Result<RkeyWalk> walkRkey(std::span<const std::uint8_t> bytes) {
  constexpr std::string_view kWhat = "UCX remote key";
  if (bytes.size() < kRkeyHeaderBytes) {
    return bad(kWhat, fmt::format("{} bytes, shorter than its {}-byte header", bytes.size(), kRkeyHeaderBytes));
  }
  RkeyWalk walk;
  std::memcpy(&walk.md_map, bytes.data(), sizeof(walk.md_map));
  walk.mem_type = bytes[8];
  walk.md_key_bytes.assign(64, 0);
  Cursor c(bytes);
  (void)c.skip(kRkeyHeaderBytes);
  for (std::uint64_t map = walk.md_map; map != 0; map &= map - 1) {
    const auto md = static_cast<std::size_t>(std::countr_zero(map));
    const auto size = c.byte();
    if (!size || !c.skip(*size)) return bad(kWhat, fmt::format("truncated in the key of memory domain {}", md));
    walk.md_key_bytes[md] = *size;
  }
  if (c.left() != 0) return bad(kWhat, fmt::format("{} bytes after the last memory domain's key", c.left()));
  return walk;
}

}  // namespace

Result<UcxBlobCheck> UcxBlobCheck::create(std::span<const std::uint8_t> own_address,
                                          std::span<const std::uint8_t> own_rkey) {
  if (own_address.empty()) return makeError(ErrorCode::Unsupported, "this UCX packed an empty worker address");
  const std::uint8_t version = own_address[0] & kVersionMask;
  std::optional<AddressShape> address;
  if (version == kVersionV1 || version == kVersionV2) {
    for (const std::size_t attr : version == kVersionV1 ? kAttrBytesV1 : kAttrBytesV2) {
      auto walk = walkAddress(own_address, attr, nullptr);
      if (!walk.ok()) continue;
      address = AddressShape{std::move(walk->header), attr, std::move(walk->transports)};
      break;
    }
  }
  if (!address) {
    return makeError(ErrorCode::Unsupported,
                     fmt::format("this UCX's worker address (header 0x{:02x}, {} bytes) is not a format kvtransfer "
                                 "can check (UCX 1.13 v1/v2, non-unified mode); refusing to pass peers' addresses "
                                 "to it unchecked",
                                 own_address[0], own_address.size()));
  }
  auto rkey = walkRkey(own_rkey);
  if (!rkey.ok()) {
    return makeError(ErrorCode::Unsupported,
                     "this UCX's remote keys are not a format kvtransfer can check: " + rkey.error().message);
  }
  return UcxBlobCheck(std::move(*address), RkeyShape{rkey->md_map, rkey->mem_type, std::move(rkey->md_key_bytes)});
}

Status UcxBlobCheck::checkWorkerAddress(std::span<const std::uint8_t> address) const {
  constexpr std::string_view kWhat = "UCX worker address";
  if (address.size() < address_.header.size() ||
      !std::equal(address_.header.begin(), address_.header.end(), address.begin())) {
    return bad(kWhat,
               fmt::format("header {} differs from this UCX's {} (another UCX version or configuration, or a "
                           "corrupted address)",
                           hex(address.first(std::min(address.size(), address_.header.size()))), hex(address_.header)));
  }
  auto walk = walkAddress(address, address_.attr_bytes, &address_.transports);
  if (!walk.ok()) return std::move(walk).error();
  return okStatus();
}

Status UcxBlobCheck::checkRemoteKey(std::span<const std::uint8_t> rkey) const {
  constexpr std::string_view kWhat = "UCX remote key";
  PD_ASSIGN_OR_RETURN(const RkeyWalk walk, walkRkey(rkey));
  if ((walk.md_map & ~rkey_.md_map) != 0) {
    return bad(kWhat, fmt::format("names memory domains 0x{:x} that this UCX does not have (it has 0x{:x})",
                                  walk.md_map & ~rkey_.md_map, rkey_.md_map));
  }
  if (walk.mem_type != rkey_.mem_type) {
    return bad(kWhat, fmt::format("memory type {}, this UCX registers {}", walk.mem_type, rkey_.mem_type));
  }
  for (std::uint64_t map = walk.md_map; map != 0; map &= map - 1) {
    const auto md = static_cast<std::size_t>(std::countr_zero(map));
    if (walk.md_key_bytes[md] != rkey_.md_key_bytes[md]) {
      return bad(kWhat, fmt::format("memory domain {}'s key is {} bytes, this UCX packs {}", md, walk.md_key_bytes[md],
                                    rkey_.md_key_bytes[md]));
    }
  }
  return okStatus();
}

}  // namespace pd::kvtransfer::ucx
