#pragma once
/// Safetensors checkpoints: memory-mapped, validated readers for one file or a sharded folder
/// (model.safetensors.index.json), and a writer.
///
/// Every structural property is validated at open: header length bound, well-formed JSON,
/// known dtypes, offsets inside the data section, tensors not overlapping, byte length equal to
/// shape x dtype size, index entries pointing at existing shards holding the named tensor.
/// Errors are ErrorCode::Corrupt / Io / NotFound with a message naming the file and tensor.
///
/// Thread rules: immutable after open; all const methods are thread-safe. The mapping lives as
/// long as the owning object; TensorView spans must not outlive it.

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

/// One tensor inside a mapped file. `data` points into the mapping.
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
  std::filesystem::path file;  ///< the shard that holds it

  [[nodiscard]] std::int64_t numel() const;
};

/// One memory-mapped .safetensors file. Move-only; unmaps in its destructor.
class SafetensorsFile {
 public:
  /// Maps and validates `path`. Never crashes on a malformed file.
  static Result<SafetensorsFile> open(const std::filesystem::path& path);
  /// Validates an in-memory image (used by the fuzz target and tests). The bytes must outlive
  /// the returned object. `name` is used in error messages.
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

/// A checkpoint: a folder with model.safetensors, or model.safetensors.index.json + shards,
/// or a single .safetensors path. Tensor names are unique across shards (checked).
class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::filesystem::path& dir_or_file);

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;
  ~Checkpoint();

  [[nodiscard]] const TensorView* find(std::string_view name) const;
  /// All tensors, sorted by name.
  [[nodiscard]] std::vector<const TensorView*> tensors() const;
  [[nodiscard]] const std::vector<SafetensorsFile>& files() const;
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

/// Writes one .safetensors file (header padded to 8 bytes, tensors aligned to their element
/// size), atomically (temp file + rename). InvalidArgument on inconsistent input.
Status writeSafetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

/// Writes model.safetensors.index.json mapping tensor name -> shard file name.
Status writeSafetensorsIndex(const std::filesystem::path& path,
                             const std::map<std::string, std::string>& weight_map,
                             std::uint64_t total_size);

}  // namespace pd
