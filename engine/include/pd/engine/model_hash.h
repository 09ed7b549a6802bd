#pragma once
/// The model hash of a checkpoint folder: the `model_hash` of kvtransfer's CompatInfo and of
/// WorkerStatus, which a prefill and a decode worker of one deployment must agree on (a KV cache
/// computed by one model means nothing to another).
///
/// It is the first 8 bytes (big-endian) of a SHA-256 over config.json and, for every
/// `*.safetensors` file in name order, its name, size, header and the first and last 64 KiB of
/// its tensor data: cheap on a 700 GB checkpoint, and different for different configs, tensor
/// sets or weights (make-model seeds differ in every tensor's bytes).
///
/// In common because prefill and decode workers (and pdserve) both compute it.
///
/// Thread rules: a pure function of the files; thread-safe.

#include <cstdint>
#include <filesystem>
#include <string>

#include "pd/common/result.h"

namespace pd {

/// NotFound when config.json or every safetensors file is missing; Io / Corrupt when a file
/// cannot be read or its header length is impossible.
[[nodiscard]] Result<std::uint64_t> modelHash(const std::filesystem::path& model_dir);

/// The 16 lowercase hex digits WorkerStatus carries.
[[nodiscard]] std::string modelHashHex(std::uint64_t hash);

}  // namespace pd
