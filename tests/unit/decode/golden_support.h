#pragma once
// Golden data shared by the decode tests (tests/data/golden, README in that folder).

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "pd/common/check.h"
#include "pd/engine/safetensors.h"

namespace pd::decode::test_support {

inline std::filesystem::path goldenDir() {
  return std::filesystem::path(PD_TEST_DATA_DIR) / "golden";
}

// Integer tensor `name` (I64 or I32) of a golden.safetensors file as int32 token ids.
inline std::vector<std::int32_t> goldenIds(const std::filesystem::path& file, const std::string& name) {
  auto f = SafetensorsFile::open(file);
  PD_CHECK_MSG(f.ok(), "cannot open golden.safetensors");
  const TensorView* t = f->find(name);
  PD_CHECK_MSG(t != nullptr, "golden tensor missing");
  std::vector<std::int32_t> v(static_cast<std::size_t>(t->numel()));
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (t->dtype == DType::I64) {
      std::int64_t x = 0;
      std::memcpy(&x, t->data.data() + i * 8, 8);
      v[i] = static_cast<std::int32_t>(x);
    } else {
      std::memcpy(&v[i], t->data.data() + i * 4, 4);
    }
  }
  return v;
}

}  // namespace pd::decode::test_support
