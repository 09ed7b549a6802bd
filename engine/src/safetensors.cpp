#include "pd/engine/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <boost/json/basic_parser_impl.hpp>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <string_view>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "pd/common/log.h"

namespace pd {

namespace {

namespace fs = std::filesystem;
namespace json = boost::json;

// A real header (DeepSeek-V3 shard: ~100 KB) is far below this; the bound stops a corrupt
// length from making us parse or allocate gigabytes.
constexpr std::uint64_t kMaxHeaderBytes = 100ULL << 20;
constexpr std::uint64_t kMaxIndexBytes = 100ULL << 20;
constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
constexpr std::string_view kSingleFileName = "model.safetensors";
constexpr std::string_view kLogComponent = "safetensors";

Error fileError(ErrorCode code, std::string_view file, std::string_view what) {
  return makeError(code, fmt::format("{}: {}", file, what));
}

Error tensorError(std::string_view file, std::string_view tensor, std::string_view what) {
  return makeError(ErrorCode::Corrupt, fmt::format("{}: tensor '{}': {}", file, tensor, what));
}

Error errnoError(std::string_view file, std::string_view what, int err) {
  return makeError(err == ENOENT ? ErrorCode::NotFound : ErrorCode::Io,
                   fmt::format("{}: {}: {}", file, what, std::strerror(err)));
}

// Closes a POSIX file descriptor when the scope ends (or earlier, via close()).
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] int get() const { return fd_; }
  /// Closes now and reports close()'s errno (0 on success); a write error can surface here.
  int close() {
    const int fd = std::exchange(fd_, -1);
    return (fd >= 0 && ::close(fd) != 0) ? errno : 0;
  }

 private:
  int fd_;
};

// A read-only private mapping of a whole file; unmapped in the destructor.
class FileMapping {
 public:
  static Result<std::unique_ptr<FileMapping>> map(const fs::path& path) {
    const std::string name = path.string();
    const ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) return errnoError(name, "cannot open", errno);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return errnoError(name, "cannot stat", errno);
    if (!S_ISREG(st.st_mode)) return fileError(ErrorCode::Io, name, "not a regular file");
    const auto size = static_cast<std::size_t>(st.st_size);
    if (size == 0) return std::unique_ptr<FileMapping>(new FileMapping(nullptr, 0));
    void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (addr == MAP_FAILED) return errnoError(name, "mmap failed", errno);
    return std::unique_ptr<FileMapping>(new FileMapping(addr, size));
  }

  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  ~FileMapping() {
    if (addr_ != nullptr && ::munmap(addr_, size_) != 0) {
      log::warn(kLogComponent, "munmap failed: {}", std::strerror(errno));
    }
  }

  [[nodiscard]] std::span<const std::byte> bytes() const { return {static_cast<const std::byte*>(addr_), size_}; }

 private:
  FileMapping(void* addr, std::size_t size) : addr_(addr), size_(size) {}

  void* addr_;
  std::size_t size_;
};

// SAX pass over a JSON text that fails on a repeated key in any object. The DOM parser keeps
// only the last of repeated keys, which would silently hide a tensor listed twice.
class DuplicateKeyFinder {
 public:
  // boost::json::basic_parser requires a handler's limits and callbacks under these names.
  // NOLINTBEGIN(readability-identifier-naming)
  static constexpr std::size_t max_array_size = std::numeric_limits<std::size_t>::max();
  static constexpr std::size_t max_object_size = std::numeric_limits<std::size_t>::max();
  static constexpr std::size_t max_string_size = std::numeric_limits<std::size_t>::max();
  static constexpr std::size_t max_key_size = std::numeric_limits<std::size_t>::max();

  using ErrorCodeT = boost::system::error_code;

  bool on_document_begin(ErrorCodeT&) { return true; }
  bool on_document_end(ErrorCodeT&) { return true; }
  bool on_array_begin(ErrorCodeT&) { return true; }
  bool on_array_end(std::size_t, ErrorCodeT&) { return true; }
  bool on_object_begin(ErrorCodeT&) {
    keys_.emplace_back();
    return true;
  }
  bool on_object_end(std::size_t, ErrorCodeT&) {
    keys_.pop_back();
    return true;
  }
  bool on_string_part(json::string_view, std::size_t, ErrorCodeT&) { return true; }
  bool on_string(json::string_view, std::size_t, ErrorCodeT&) { return true; }
  bool on_key_part(json::string_view part, std::size_t, ErrorCodeT&) {
    key_.append(part.data(), part.size());
    return true;
  }
  bool on_key(json::string_view part, std::size_t, ErrorCodeT& ec) {
    key_.append(part.data(), part.size());
    if (!keys_.back().insert(key_).second) {
      duplicate_ = key_;
      ec = json::error::syntax;
      return false;
    }
    key_.clear();
    return true;
  }
  bool on_number_part(json::string_view, ErrorCodeT&) { return true; }
  bool on_int64(std::int64_t, json::string_view, ErrorCodeT&) { return true; }
  bool on_uint64(std::uint64_t, json::string_view, ErrorCodeT&) { return true; }
  bool on_double(double, json::string_view, ErrorCodeT&) { return true; }
  bool on_bool(bool, ErrorCodeT&) { return true; }
  bool on_null(ErrorCodeT&) { return true; }
  bool on_comment_part(json::string_view, ErrorCodeT&) { return true; }
  bool on_comment(json::string_view, ErrorCodeT&) { return true; }
  // NOLINTEND(readability-identifier-naming)

  [[nodiscard]] const std::optional<std::string>& duplicate() const { return duplicate_; }

 private:
  std::vector<std::unordered_set<std::string>> keys_;
  std::string key_;
  std::optional<std::string> duplicate_;
};

// Parses strict JSON (no comments, valid UTF-8, depth <= 32, no repeated keys) into a DOM.
Result<json::value> parseJsonStrict(std::string_view text, std::string_view file, std::string_view what) {
  json::parse_options options;
  {
    json::basic_parser<DuplicateKeyFinder> sax(options);
    boost::system::error_code ec;
    const std::size_t used = sax.write_some(false, text.data(), text.size(), ec);
    if (sax.handler().duplicate()) {
      return fileError(ErrorCode::Corrupt, file,
                       fmt::format("{}: key '{}' appears twice", what, *sax.handler().duplicate()));
    }
    if (ec) {
      return fileError(ErrorCode::Corrupt, file,
                       fmt::format("{} is not valid JSON ({} at byte {})", what, ec.message(), used));
    }
    if (used != text.size()) {
      return fileError(ErrorCode::Corrupt, file, fmt::format("{}: trailing bytes after the JSON value", what));
    }
  }
  boost::system::error_code ec;
  json::value root = json::parse(json::string_view(text.data(), text.size()), ec, {}, options);
  if (ec) {
    return fileError(ErrorCode::Corrupt, file, fmt::format("{} is not valid JSON ({})", what, ec.message()));
  }
  return root;
}

// A JSON number that is a non-negative integer, else nullopt (doubles, negatives, strings...).
std::optional<std::uint64_t> nonNegativeInteger(const json::value& v) {
  if (v.is_uint64()) return v.get_uint64();
  if (v.is_int64() && v.get_int64() >= 0) return static_cast<std::uint64_t>(v.get_int64());
  return std::nullopt;
}

std::string shapeText(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// numel x element size, or nullopt when it (or numel itself, as int64) overflows.
std::optional<std::uint64_t> byteLength(const std::vector<std::int64_t>& shape, std::size_t element_size) {
  std::uint64_t numel = 1;
  for (const std::int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    const auto d = static_cast<std::uint64_t>(dim);
    if (d != 0 && numel > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / d) {
      return std::nullopt;
    }
    numel *= d;
  }
  if (numel > std::numeric_limits<std::uint64_t>::max() / element_size) return std::nullopt;
  return numel * element_size;
}

struct ParsedTensor {
  TensorView view;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

Result<ParsedTensor> parseTensorEntry(const std::string& file, const std::string& name, const json::value& entry,
                                      std::uint64_t data_size) {
  const json::object* obj = entry.if_object();
  if (obj == nullptr) return tensorError(file, name, "header entry is not a JSON object");

  const json::value* dtype_value = obj->if_contains("dtype");
  if (dtype_value == nullptr || !dtype_value->is_string()) {
    return tensorError(file, name, "'dtype' is missing or not a string");
  }
  const json::string& dtype_name = dtype_value->get_string();
  const std::optional<DType> dtype = parseDType(std::string_view(dtype_name.data(), dtype_name.size()));
  if (!dtype) return tensorError(file, name, fmt::format("unknown dtype '{}'", std::string_view(dtype_name)));

  const json::value* shape_value = obj->if_contains("shape");
  if (shape_value == nullptr || !shape_value->is_array()) {
    return tensorError(file, name, "'shape' is missing or not a list");
  }
  std::vector<std::int64_t> shape;
  shape.reserve(shape_value->get_array().size());
  for (const json::value& dim : shape_value->get_array()) {
    const std::optional<std::uint64_t> d = nonNegativeInteger(dim);
    if (!d || *d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return tensorError(
          file, name,
          fmt::format("'shape' is not a list of non-negative integers ({})", json::serialize(*shape_value)));
    }
    shape.push_back(static_cast<std::int64_t>(*d));
  }
  const std::optional<std::uint64_t> expected_bytes = byteLength(shape, dtypeSize(*dtype));
  if (!expected_bytes) {
    return tensorError(file, name, fmt::format("shape {} x {} overflows 64 bits", shapeText(shape), dtypeName(*dtype)));
  }

  const json::value* offsets_value = obj->if_contains("data_offsets");
  const json::array* offsets = offsets_value == nullptr ? nullptr : offsets_value->if_array();
  std::optional<std::uint64_t> begin;
  std::optional<std::uint64_t> end;
  if (offsets != nullptr && offsets->size() == 2) {
    begin = nonNegativeInteger((*offsets)[0]);
    end = nonNegativeInteger((*offsets)[1]);
  }
  if (!begin || !end) return tensorError(file, name, "'data_offsets' is not a list of two non-negative integers");
  if (*begin > *end) return tensorError(file, name, fmt::format("data_offsets begin {} > end {}", *begin, *end));
  if (*end > data_size) {
    return tensorError(
        file, name,
        fmt::format("data_offsets end {} is beyond the data section ({} bytes); file truncated?", *end, data_size));
  }
  if (*end - *begin != *expected_bytes) {
    return tensorError(file, name,
                       fmt::format("holds {} bytes but shape {} x {} needs {}", *end - *begin, shapeText(shape),
                                   dtypeName(*dtype), *expected_bytes));
  }

  ParsedTensor out;
  out.view.name = name;
  out.view.dtype = *dtype;
  out.view.shape = std::move(shape);
  out.begin = *begin;
  out.end = *end;
  return out;
}

// Reads a whole (small) file into memory.
Result<std::string> readSmallFile(const fs::path& path, std::uint64_t max_bytes) {
  const std::string name = path.string();
  const ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return errnoError(name, "cannot open", errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errnoError(name, "cannot stat", errno);
  if (!S_ISREG(st.st_mode)) return fileError(ErrorCode::Io, name, "not a regular file");
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    return fileError(ErrorCode::Corrupt, name,
                     fmt::format("{} bytes is larger than the {} byte limit", st.st_size, max_bytes));
  }
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(fd.get(), text.data() + done, text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return errnoError(name, "read failed", errno);
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  text.resize(done);
  return text;
}

// Writes every byte or returns the errno that stopped it (0 on success).
int writeAll(int fd, std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const ssize_t put = ::write(fd, bytes.data(), bytes.size());
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) return errno;
    if (put == 0) return EIO;
    bytes = bytes.subspan(static_cast<std::size_t>(put));
  }
  return 0;
}

// Writes `pieces` to a temporary file next to `path`, syncs it, and renames it over `path`, so a
// reader sees either the old file or the whole new one.
Status writeFileAtomically(const fs::path& path, const std::vector<std::span<const std::byte>>& pieces) {
  const std::string name = path.string();
  std::string temp = name + ".tmp.XXXXXX";
  ScopedFd fd(::mkstemp(temp.data()));
  if (fd.get() < 0) return errnoError(name, "cannot create a temporary file", errno);
  auto fail = [&](std::string_view what, int err) {
    ::unlink(temp.c_str());
    return makeError(ErrorCode::Io, fmt::format("{}: {}: {}", name, what, std::strerror(err)));
  };
  if (::fchmod(fd.get(), 0644) != 0) return fail("fchmod failed", errno);
  for (const std::span<const std::byte> piece : pieces) {
    if (const int err = writeAll(fd.get(), piece); err != 0) return fail("write failed", err);
  }
  if (::fsync(fd.get()) != 0) return fail("fsync failed", errno);
  if (const int err = fd.close(); err != 0) return fail("close failed", err);
  if (::rename(temp.c_str(), path.c_str()) != 0) return fail("rename failed", errno);
  // Make the rename itself durable; a failure here leaves a complete file, so only log it.
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  const ScopedFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0 || ::fsync(dir_fd.get()) != 0) {
    log::warn(kLogComponent, "{}: could not fsync the directory: {}", name, std::strerror(errno));
  }
  return okStatus();
}

std::span<const std::byte> asBytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

}  // namespace

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t dim : shape) n *= dim;
  return n;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

namespace {

// What a SafetensorsFile owns; a namespace-scope struct so the helpers below can fill it.
struct FileState {
  fs::path path;
  std::unique_ptr<FileMapping> mapping;  // null for fromBytes()
  std::span<const std::byte> bytes;
  std::vector<TensorView> tensors;
  std::map<std::string, std::size_t, std::less<>> index;
  std::map<std::string, std::string> metadata;
};

// Validates a whole safetensors image and fills impl.tensors / index / metadata.
Status parseImage(FileState& impl) {
  const std::string file = impl.path.string();
  const std::span<const std::byte> bytes = impl.bytes;
  if (bytes.size() < 8) {
    return fileError(ErrorCode::Corrupt, file,
                     fmt::format("{} bytes is shorter than the 8-byte header length", bytes.size()));
  }
  std::uint64_t header_len = 0;
  for (std::size_t i = 0; i < 8; ++i) {
    header_len |= static_cast<std::uint64_t>(std::to_integer<std::uint8_t>(bytes[i])) << (8 * i);
  }
  if (header_len > kMaxHeaderBytes) {
    return fileError(ErrorCode::Corrupt, file,
                     fmt::format("header length {} exceeds the {} byte limit", header_len, kMaxHeaderBytes));
  }
  if (header_len > bytes.size() - 8) {
    return fileError(
        ErrorCode::Corrupt, file,
        fmt::format("header length {} exceeds the file size {}; file truncated?", header_len, bytes.size()));
  }
  const std::span<const std::byte> header_bytes = bytes.subspan(8, static_cast<std::size_t>(header_len));
  const std::span<const std::byte> data = bytes.subspan(8 + static_cast<std::size_t>(header_len));
  const std::string_view header(reinterpret_cast<const char*>(header_bytes.data()), header_bytes.size());

  PD_ASSIGN_OR_RETURN(json::value root, parseJsonStrict(header, file, "header"));
  const json::object* top = root.if_object();
  if (top == nullptr) return fileError(ErrorCode::Corrupt, file, "header is not a JSON object");

  std::vector<ParsedTensor> parsed;
  parsed.reserve(top->size());
  for (const json::key_value_pair& kv : *top) {
    const std::string key(kv.key());
    if (key == kMetadataKey) {
      const json::object* meta = kv.value().if_object();
      if (meta == nullptr) return fileError(ErrorCode::Corrupt, file, "__metadata__ is not a JSON object");
      for (const json::key_value_pair& m : *meta) {
        if (!m.value().is_string()) {
          return fileError(ErrorCode::Corrupt, file,
                           fmt::format("__metadata__ value of '{}' is not a string", std::string_view(m.key())));
        }
        impl.metadata.emplace(std::string(m.key()), std::string(m.value().get_string()));
      }
      continue;
    }
    PD_ASSIGN_OR_RETURN(ParsedTensor tensor, parseTensorEntry(file, key, kv.value(), data.size()));
    parsed.push_back(std::move(tensor));
  }

  std::sort(parsed.begin(), parsed.end(), [](const ParsedTensor& a, const ParsedTensor& b) {
    return std::tie(a.begin, a.end, a.view.name) < std::tie(b.begin, b.end, b.view.name);
  });
  // Sorted by begin, a non-empty tensor overlaps an earlier one exactly when it starts before the
  // furthest end seen so far. Empty tensors occupy no bytes and cannot overlap.
  const ParsedTensor* furthest = nullptr;
  for (const ParsedTensor& t : parsed) {
    if (t.begin == t.end) continue;
    if (furthest != nullptr && t.begin < furthest->end) {
      return tensorError(file, t.view.name,
                         fmt::format("bytes [{}, {}) overlap tensor '{}' at [{}, {})", t.begin, t.end,
                                     furthest->view.name, furthest->begin, furthest->end));
    }
    if (furthest == nullptr || t.end > furthest->end) furthest = &t;
  }

  impl.tensors.reserve(parsed.size());
  for (ParsedTensor& t : parsed) {
    t.view.data = data.subspan(static_cast<std::size_t>(t.begin), static_cast<std::size_t>(t.end - t.begin));
    t.view.file = impl.path;
    impl.index.emplace(t.view.name, impl.tensors.size());
    impl.tensors.push_back(std::move(t.view));
  }
  return okStatus();
}

}  // namespace

struct SafetensorsFile::Impl : FileState {};

SafetensorsFile::SafetensorsFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

Result<SafetensorsFile> SafetensorsFile::open(const fs::path& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  PD_ASSIGN_OR_RETURN(impl->mapping, FileMapping::map(path));
  impl->bytes = impl->mapping->bytes();
  PD_TRY(parseImage(*impl));
  log::debug(kLogComponent, "{}: {} tensors, {} bytes", path.string(), impl->tensors.size(), impl->bytes.size());
  return SafetensorsFile(std::move(impl));
}

Result<SafetensorsFile> SafetensorsFile::fromBytes(std::span<const std::byte> bytes, std::string name) {
  auto impl = std::make_unique<Impl>();
  impl->path = fs::path(std::move(name));
  impl->bytes = bytes;
  PD_TRY(parseImage(*impl));
  return SafetensorsFile(std::move(impl));
}

const fs::path& SafetensorsFile::path() const {
  return impl_->path;
}
const std::vector<TensorView>& SafetensorsFile::tensors() const {
  return impl_->tensors;
}
const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return impl_->metadata;
}
std::size_t SafetensorsFile::fileSize() const {
  return impl_->bytes.size();
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  const auto it = impl_->index.find(name);
  return it == impl_->index.end() ? nullptr : &impl_->tensors[it->second];
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {

// What a Checkpoint owns; a namespace-scope struct so the helpers below can fill it.
struct CheckpointState {
  std::vector<SafetensorsFile> files;
  std::map<std::string, const TensorView*, std::less<>> by_name;
  std::uint64_t total_bytes = 0;
};

// Adds every tensor of `file` to the name table; a name already present is a tensor stored twice.
Status addFileTensors(CheckpointState& impl, const SafetensorsFile& file, std::string_view context) {
  for (const TensorView& t : file.tensors()) {
    const auto [it, inserted] = impl.by_name.emplace(t.name, &t);
    if (!inserted) {
      return makeError(ErrorCode::Corrupt, fmt::format("{}: tensor '{}' is stored in two shards: {} and {}", context,
                                                       t.name, it->second->file.string(), t.file.string()));
    }
    impl.total_bytes += t.data.size();
  }
  return okStatus();
}

// A shard name from an index must stay inside the checkpoint folder.
bool isSafeShardName(const std::string& shard) {
  if (shard.empty()) return false;
  const fs::path p(shard);
  if (p.is_absolute()) return false;
  return std::none_of(p.begin(), p.end(), [](const fs::path& part) { return part == ".."; });
}

Status openIndexed(CheckpointState& impl, const fs::path& index_path) {
  const std::string index_name = index_path.string();
  PD_ASSIGN_OR_RETURN(const std::string text, readSmallFile(index_path, kMaxIndexBytes));
  PD_ASSIGN_OR_RETURN(const json::value root, parseJsonStrict(text, index_name, "index"));
  const json::object* top = root.if_object();
  if (top == nullptr) return fileError(ErrorCode::Corrupt, index_name, "index is not a JSON object");
  const json::value* map_value = top->if_contains("weight_map");
  if (map_value == nullptr || !map_value->is_object()) {
    return fileError(ErrorCode::Corrupt, index_name, "'weight_map' is missing or not a JSON object");
  }
  const json::object& weight_map = map_value->get_object();
  if (weight_map.empty()) return fileError(ErrorCode::Corrupt, index_name, "'weight_map' is empty");

  std::map<std::string, std::vector<std::string>> names_by_shard;
  for (const json::key_value_pair& kv : weight_map) {
    const std::string tensor(kv.key());
    if (!kv.value().is_string()) {
      return makeError(ErrorCode::Corrupt,
                       fmt::format("{}: tensor '{}': shard name is not a string", index_name, tensor));
    }
    std::string shard(kv.value().get_string());
    if (!isSafeShardName(shard)) {
      return makeError(ErrorCode::Corrupt, fmt::format("{}: tensor '{}': shard name '{}' is empty or leaves the folder",
                                                       index_name, tensor, shard));
    }
    names_by_shard[std::move(shard)].push_back(tensor);
  }

  const fs::path dir = index_path.parent_path();
  impl.files.reserve(names_by_shard.size());
  for (const auto& [shard, names] : names_by_shard) {
    const fs::path shard_path = dir / shard;
    Result<SafetensorsFile> file = SafetensorsFile::open(shard_path);
    if (!file.ok()) {
      if (file.error().code == ErrorCode::NotFound) {
        return makeError(ErrorCode::NotFound,
                         fmt::format("{}: tensor '{}' maps to shard '{}', which does not exist ({})", index_name,
                                     names.front(), shard, file.error().message));
      }
      return std::move(file).error();
    }
    for (const std::string& name : names) {
      if (file->find(name) == nullptr) {
        return makeError(ErrorCode::Corrupt, fmt::format("{}: tensor '{}' is mapped to {}, which does not contain it",
                                                         index_name, name, shard_path.string()));
      }
    }
    impl.files.push_back(std::move(file).value());
  }
  for (const SafetensorsFile& file : impl.files) PD_TRY(addFileTensors(impl, file, index_name));
  return okStatus();
}

Status openSingle(CheckpointState& impl, const fs::path& path) {
  PD_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
  impl.files.push_back(std::move(file));
  return addFileTensors(impl, impl.files.back(), path.string());
}

bool endsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

}  // namespace

struct Checkpoint::Impl : CheckpointState {};

Checkpoint::Checkpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

Result<Checkpoint> Checkpoint::open(const fs::path& dir_or_file) {
  const std::string name = dir_or_file.string();
  std::error_code ec;
  const fs::file_status status = fs::status(dir_or_file, ec);
  if (status.type() == fs::file_type::not_found) {
    return fileError(ErrorCode::NotFound, name, "no such file or directory");
  }
  if (ec) return fileError(ErrorCode::Io, name, fmt::format("cannot stat: {}", ec.message()));

  auto impl = std::make_unique<Impl>();
  if (fs::is_directory(status)) {
    const fs::path index = dir_or_file / kIndexFileName;
    const fs::path single = dir_or_file / kSingleFileName;
    if (fs::exists(index, ec)) {
      PD_TRY(openIndexed(*impl, index));
    } else if (fs::exists(single, ec)) {
      PD_TRY(openSingle(*impl, single));
    } else {
      return fileError(ErrorCode::NotFound, name,
                       fmt::format("folder has neither {} nor {}", kIndexFileName, kSingleFileName));
    }
  } else if (endsWith(dir_or_file.filename().string(), ".index.json")) {
    PD_TRY(openIndexed(*impl, dir_or_file));
  } else {
    PD_TRY(openSingle(*impl, dir_or_file));
  }
  log::debug(kLogComponent, "{}: {} files, {} tensors, {} bytes", name, impl->files.size(), impl->by_name.size(),
             impl->total_bytes);
  return Checkpoint(std::move(impl));
}

const TensorView* Checkpoint::find(std::string_view name) const {
  const auto it = impl_->by_name.find(name);
  return it == impl_->by_name.end() ? nullptr : it->second;
}

std::vector<const TensorView*> Checkpoint::tensors() const {
  std::vector<const TensorView*> out;
  out.reserve(impl_->by_name.size());
  for (const auto& [name, view] : impl_->by_name) out.push_back(view);
  return out;
}

const std::vector<SafetensorsFile>& Checkpoint::files() const {
  return impl_->files;
}
std::uint64_t Checkpoint::totalTensorBytes() const {
  return impl_->total_bytes;
}

// ---------------------------------------------------------------------------------------------
// Writers

Status writeSafetensors(const fs::path& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  std::set<std::string_view> seen;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == kMetadataKey) {
      return fileError(ErrorCode::InvalidArgument, file, fmt::format("invalid tensor name '{}'", t.name));
    }
    if (!seen.insert(t.name).second) {
      return makeError(ErrorCode::InvalidArgument, fmt::format("{}: tensor '{}' given twice", file, t.name));
    }
    const std::optional<std::uint64_t> bytes = byteLength(t.shape, dtypeSize(t.dtype));
    if (!bytes || *bytes != t.data.size()) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("{}: tensor '{}': {} data bytes do not match shape {} x {}", file, t.name,
                                   t.data.size(), shapeText(t.shape), dtypeName(t.dtype)));
    }
  }

  // Largest elements first, so each tensor starts at a multiple of its element size.
  std::vector<const TensorToWrite*> order;
  order.reserve(tensors.size());
  for (const TensorToWrite& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorToWrite* a, const TensorToWrite* b) {
    const std::size_t sa = dtypeSize(a->dtype);
    const std::size_t sb = dtypeSize(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });

  json::object header;
  if (!metadata.empty()) {
    json::object meta;
    for (const auto& [key, value] : metadata) meta.emplace(key, value);
    header.emplace(kMetadataKey, std::move(meta));
  }
  std::uint64_t offset = 0;
  for (const TensorToWrite* t : order) {
    json::object entry;
    entry.emplace("dtype", dtypeName(t->dtype));
    json::array shape;
    for (const std::int64_t dim : t->shape) shape.emplace_back(dim);
    entry.emplace("shape", std::move(shape));
    entry.emplace("data_offsets", json::array{offset, offset + t->data.size()});
    header.emplace(t->name, std::move(entry));
    offset += t->data.size();
  }
  std::string header_text = json::serialize(header);
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  std::array<std::byte, 8> length_prefix{};
  for (std::size_t i = 0; i < 8; ++i) {
    length_prefix[i] = static_cast<std::byte>((static_cast<std::uint64_t>(header_text.size()) >> (8 * i)) & 0xFF);
  }
  std::vector<std::span<const std::byte>> pieces;
  pieces.reserve(order.size() + 2);
  pieces.emplace_back(length_prefix);
  pieces.push_back(asBytes(header_text));
  for (const TensorToWrite* t : order) pieces.push_back(t->data);
  return writeFileAtomically(path, pieces);
}

Status writeSafetensorsIndex(const fs::path& path, const std::map<std::string, std::string>& weight_map,
                             std::uint64_t total_size) {
  json::object map;
  for (const auto& [tensor, shard] : weight_map) {
    if (!isSafeShardName(shard)) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("{}: tensor '{}': invalid shard name '{}'", path.string(), tensor, shard));
    }
    map.emplace(tensor, shard);
  }
  json::object root;
  root.emplace("metadata", json::object{{"total_size", total_size}});
  root.emplace("weight_map", std::move(map));
  const std::string text = json::serialize(root) + "\n";
  return writeFileAtomically(path, {asBytes(text)});
}

}  // namespace pd
