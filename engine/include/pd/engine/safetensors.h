#pragma once
/// Safetensors checkpoints: memory-mapped, validated readers for one file or a sharded folder
/// (model.safetensors.index.json), and a writer.
///
/// Every structural property is validated at open: header length bound (100 MiB and the file
/// size), strict JSON (valid UTF-8, no repeated keys, depth <= 32), a JSON object, known dtypes,
/// shapes of non-negative integers whose byte size fits in 64 bits, data_offsets of two
/// non-negative integers with begin <= end inside the data section, byte length equal to
/// shape x dtype size, no two non-empty tensors overlapping, __metadata__ string -> string;
/// index entries pointing at existing shards (inside the folder) holding the named tensor, and
/// no tensor stored in two shards. Gaps between tensors and trailing bytes are allowed.
/// Errors are ErrorCode::Corrupt / Io / NotFound with a message "<file>: tensor '<name>': ..."
/// (the tensor part where one is involved). Nothing is read outside the file or buffer.
///
/// Thread rules: immutable after open; all const methods are thread-safe. The mapping lives as
/// long as the owning object (moves keep it); TensorView spans must not outlive it. A file
/// truncated by another process while mapped faults (SIGBUS) on access, as with any mmap.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/common/result.h"

namespace pd {

/// One tensor inside a mapped file. `data` points into the mapping. It is aligned to the element
/// size when the file was written with tensors sorted by element size (writeSafetensors, Hugging
/// Face/torch) and the buffer is 8-byte aligned (any mapping); for other files read the bytes
/// with memcpy rather than casting.
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
  std::filesystem::path file;  ///< the shard that holds it

  /// Product of the shape (1 for a scalar, 0 if any dimension is 0).
  [[nodiscard]] std::int64_t numel() const;
};

/// One memory-mapped .safetensors file. Move-only; unmaps in its destructor.
class SafetensorsFile {
 public:
  /// Maps (read-only, private) and validates `path`. Never crashes on a malformed file.
  /// NotFound if it does not exist, Io if it cannot be opened/mapped or is not a regular file,
  /// Corrupt for any malformed content.
  static Result<SafetensorsFile> open(const std::filesystem::path& path);
  /// Validates an in-memory image (used by the fuzz target and tests). The bytes must outlive
  /// the returned object. `name` is used in error messages and as path(). Errors are Corrupt.
  static Result<SafetensorsFile> fromBytes(std::span<const std::byte> bytes, std::string name);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  [[nodiscard]] const std::filesystem::path& path() const;
  /// Tensors in file order (by data offset).
  [[nodiscard]] const std::vector<TensorView>& tensors() const;
  /// nullptr when absent.
  [[nodiscard]] const TensorView* find(std::string_view name) const;
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const;
  [[nodiscard]] std::size_t fileSize() const;

 private:
  struct Impl;
  explicit SafetensorsFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// A checkpoint: a folder with model.safetensors.index.json + shards (preferred when present) or
/// model.safetensors, a path to a *.index.json, or a single .safetensors path. Only the shards
/// the index names are opened. Tensor names are unique across shards (checked).
/// Thread rules: as SafetensorsFile; TensorView pointers live as long as the Checkpoint.
class Checkpoint {
 public:
  /// NotFound for a missing path, a folder with neither file, or a shard the index names that
  /// does not exist; Corrupt for a malformed index or shard; Io when the OS refuses.
  static Result<Checkpoint> open(const std::filesystem::path& dir_or_file);

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;
  ~Checkpoint();

  [[nodiscard]] const TensorView* find(std::string_view name) const;
  /// All tensors, sorted by name.
  [[nodiscard]] std::vector<const TensorView*> tensors() const;
  /// The opened shards (sorted by shard name for an index).
  [[nodiscard]] const std::vector<SafetensorsFile>& files() const;
  /// Sum of every tensor's byte length.
  [[nodiscard]] std::uint64_t totalTensorBytes() const;

 private:
  struct Impl;
  explicit Checkpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// A tensor to write. `data.size()` must equal numel x dtypeSize(dtype).
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
};

/// Writes one .safetensors file (header padded with spaces to 8 bytes, tensors sorted by element
/// size descending then name, so each is aligned to its element size, with no gaps), atomically:
/// a temporary file in the same folder, fsync, rename. InvalidArgument on inconsistent input
/// (size mismatch, negative dimension, empty/duplicate/"__metadata__" name), before touching
/// the disk; NotFound if the folder does not exist; Io if a write fails. Blocking.
Status writeSafetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

/// Writes model.safetensors.index.json ({"metadata": {"total_size": N}, "weight_map": {...}})
/// mapping tensor name -> shard file name (relative, inside the folder), atomically as above.
/// InvalidArgument for an empty, absolute or ".." shard name.
Status writeSafetensorsIndex(const std::filesystem::path& path, const std::map<std::string, std::string>& weight_map,
                             std::uint64_t total_size);

}  // namespace pd
