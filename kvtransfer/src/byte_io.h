#pragma once
// Little-endian byte writer and bounds-checked reader for the wire messages.
// Thread rules: plain values, one thread at a time.

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace pd::kvtransfer::detail {

static_assert(std::endian::native == std::endian::little, "the wire format assumes a little-endian host");

class ByteWriter {
 public:
  template <class T>
  requires std::is_integral_v<T>
  void put(T value) {
    const auto pos = out_.size();
    out_.resize(pos + sizeof(T));
    std::memcpy(out_.data() + pos, &value, sizeof(T));
  }
  void putF32(float value) { put(std::bit_cast<std::uint32_t>(value)); }
  void putBytes(std::span<const std::uint8_t> bytes) {
    put(static_cast<std::uint32_t>(bytes.size()));
    out_.insert(out_.end(), bytes.begin(), bytes.end());
  }
  void putString(std::string_view text) {
    put(static_cast<std::uint32_t>(text.size()));
    out_.insert(out_.end(), text.begin(), text.end());
  }
  /// Overwrites a u32 written earlier at `pos` (the payload length in the header).
  void patchU32(std::size_t pos, std::uint32_t value) { std::memcpy(out_.data() + pos, &value, sizeof(value)); }
  [[nodiscard]] std::size_t size() const { return out_.size(); }
  [[nodiscard]] std::vector<std::uint8_t> take() && { return std::move(out_); }

 private:
  std::vector<std::uint8_t> out_;
};

/// Reads fields in order; the first read past the end (or a failed check) makes the reader
/// fail and every later read return zero, so decoders check ok() once per message section.
class ByteReader {
 public:
  explicit ByteReader(std::span<const std::uint8_t> bytes) : bytes_(bytes) {}

  template <class T>
  requires std::is_integral_v<T> T get() {
    T value{};
    if (!take(sizeof(T))) return value;
    std::memcpy(&value, bytes_.data() + pos_ - sizeof(T), sizeof(T));
    return value;
  }
  float getF32() { return std::bit_cast<float>(get<std::uint32_t>()); }

  /// A u32 count, checked against `max` and against the bytes left at `element_bytes` each,
  /// so a hostile count cannot make the decoder allocate more than the input's size.
  std::uint32_t getCount(std::uint32_t max, std::size_t element_bytes) {
    const auto n = get<std::uint32_t>();
    if (!ok_) return 0;
    if (n > max || (element_bytes != 0 && static_cast<std::uint64_t>(n) * element_bytes > remaining())) {
      fail();
      return 0;
    }
    return n;
  }
  std::vector<std::uint8_t> getBytes(std::uint32_t max) {
    const auto n = getCount(max, 1);
    if (!take(n)) return {};
    return {bytes_.begin() + static_cast<std::ptrdiff_t>(pos_ - n), bytes_.begin() + static_cast<std::ptrdiff_t>(pos_)};
  }
  std::string getString(std::uint32_t max) {
    const auto n = getCount(max, 1);
    if (!take(n)) return {};
    return {reinterpret_cast<const char*>(bytes_.data()) + (pos_ - n), n};
  }

  /// The next `n` bytes, without copying (empty, and the reader failed, when fewer are left).
  std::span<const std::uint8_t> getView(std::size_t n) {
    if (!take(n)) return {};
    return bytes_.subspan(pos_ - n, n);
  }

  void fail() { ok_ = false; }
  [[nodiscard]] bool ok() const { return ok_; }
  [[nodiscard]] std::size_t remaining() const { return ok_ ? bytes_.size() - pos_ : 0; }
  [[nodiscard]] std::size_t position() const { return pos_; }

 private:
  bool take(std::size_t n) {
    if (!ok_ || bytes_.size() - pos_ < n) {
      ok_ = false;
      return false;
    }
    pos_ += n;
    return true;
  }

  std::span<const std::uint8_t> bytes_;
  std::size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace pd::kvtransfer::detail
