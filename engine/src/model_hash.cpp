#include "pd/engine/model_hash.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <string_view>
#include <system_error>
#include <vector>

#include "pd/common/sha256.h"

namespace pd {
namespace {

namespace fs = std::filesystem;

constexpr std::uint64_t kSampleBytes = std::uint64_t{64} * 1024;

void feed(Sha256& sha, std::string_view bytes) {
  sha.update(std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
}

void feedU64(Sha256& sha, std::uint64_t v) {
  std::array<char, 8> le{};
  for (std::size_t i = 0; i < 8; ++i) le[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  feed(sha, std::string_view(le.data(), le.size()));
}

// Feeds `length` bytes of `file` from `offset` (the caller checked they exist).
Status feedRange(Sha256& sha, std::ifstream& file, const fs::path& path, std::uint64_t offset, std::uint64_t length) {
  std::vector<char> buffer(static_cast<std::size_t>(length));
  file.seekg(static_cast<std::streamoff>(offset));
  if (!file.read(buffer.data(), static_cast<std::streamsize>(length))) {
    return makeError(ErrorCode::Io, fmt::format("{}: cannot read {} bytes at {}", path.string(), length, offset));
  }
  feed(sha, std::string_view(buffer.data(), buffer.size()));
  return okStatus();
}

Status feedSafetensors(Sha256& sha, const fs::path& path) {
  std::error_code ec;
  const std::uint64_t size = fs::file_size(path, ec);
  if (ec) return makeError(ErrorCode::Io, fmt::format("{}: {}", path.string(), ec.message()));
  std::ifstream file(path, std::ios::binary);
  if (!file) return makeError(ErrorCode::Io, fmt::format("{}: cannot open", path.string()));
  feed(sha, path.filename().string());
  feedU64(sha, size);
  std::array<unsigned char, 8> len_bytes{};
  if (size < 8 || !file.read(reinterpret_cast<char*>(len_bytes.data()), 8)) {
    return makeError(ErrorCode::Corrupt, fmt::format("{}: shorter than a safetensors header", path.string()));
  }
  std::uint64_t header = 0;
  for (std::size_t i = 0; i < 8; ++i) header |= std::uint64_t{len_bytes[i]} << (8 * i);
  if (header > size - 8) {
    return makeError(ErrorCode::Corrupt, fmt::format("{}: header of {} bytes exceeds the file", path.string(), header));
  }
  PD_TRY(feedRange(sha, file, path, 8, header));
  const std::uint64_t data_begin = 8 + header;
  const std::uint64_t data = size - data_begin;
  PD_TRY(feedRange(sha, file, path, data_begin, std::min(data, kSampleBytes)));
  // The tail, not overlapping the head.
  const std::uint64_t tail = data > kSampleBytes ? std::min(data - kSampleBytes, kSampleBytes) : 0;
  if (tail > 0) PD_TRY(feedRange(sha, file, path, size - tail, tail));
  return okStatus();
}

}  // namespace

Result<std::uint64_t> modelHash(const fs::path& model_dir) {
  Sha256 sha;
  feed(sha, "pdserve model hash v1");
  const fs::path config = model_dir / "config.json";
  std::error_code ec;
  if (!fs::is_regular_file(config, ec)) {
    return makeError(ErrorCode::NotFound, fmt::format("{}: no config.json", model_dir.string()));
  }
  {
    std::ifstream file(config, std::ios::binary);
    const std::uint64_t size = fs::file_size(config, ec);
    if (!file || ec) return makeError(ErrorCode::Io, fmt::format("{}: cannot read", config.string()));
    feedU64(sha, size);
    PD_TRY(feedRange(sha, file, config, 0, size));
  }
  std::vector<fs::path> shards;
  for (fs::directory_iterator it(model_dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec) && it->path().extension() == ".safetensors") shards.push_back(it->path());
  }
  if (ec) return makeError(ErrorCode::Io, fmt::format("{}: {}", model_dir.string(), ec.message()));
  if (shards.empty())
    return makeError(ErrorCode::NotFound, fmt::format("{}: no .safetensors files", model_dir.string()));
  std::sort(shards.begin(), shards.end());
  for (const fs::path& shard : shards) PD_TRY(feedSafetensors(sha, shard));
  const std::array<std::uint8_t, 32> digest = sha.finish();
  std::uint64_t hash = 0;
  for (std::size_t i = 0; i < 8; ++i) hash = (hash << 8) | digest[i];
  return hash;
}

std::string modelHashHex(std::uint64_t hash) {
  return fmt::format("{:016x}", hash);
}

}  // namespace pd
