#pragma once
// Golden reference tensors (tests/data/golden/<model>/golden.safetensors) as the prefill tests
// compare against them: F32 tensors and I64 token ids by name, the max |difference| of two
// vectors, and the golden README §6 tolerance for cache and state values.
// Thread rules: a Golden is read-only after construction.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "pd/common/check.h"
#include "pd/engine/safetensors.h"

namespace pd::prefill::testsupport {

inline constexpr double kStateTol = 2e-4;  // golden README §6

inline std::filesystem::path goldenDir() {
  return std::filesystem::path(PD_TEST_DATA_DIR) / "golden";
}

class Golden {
 public:
  explicit Golden(const std::filesystem::path& path) : file_(open(path)) {}
  [[nodiscard]] std::vector<float> f32(const std::string& name) const {
    const TensorView* t = file_.find(name);
    PD_CHECK_MSG(t != nullptr && t->dtype == DType::F32, "golden tensor missing or not F32");
    std::vector<float> v(static_cast<std::size_t>(t->numel()));
    std::memcpy(v.data(), t->data.data(), t->data.size());
    return v;
  }
  [[nodiscard]] std::vector<std::int32_t> ids(const std::string& name) const {
    const TensorView* t = file_.find(name);
    PD_CHECK_MSG(t != nullptr && t->dtype == DType::I64, "golden ids missing or not I64");
    std::vector<std::int32_t> v(static_cast<std::size_t>(t->numel()));
    for (std::size_t i = 0; i < v.size(); ++i) {
      std::int64_t x;
      std::memcpy(&x, t->data.data() + i * 8, 8);
      v[i] = static_cast<std::int32_t>(x);
    }
    return v;
  }

 private:
  static SafetensorsFile open(const std::filesystem::path& path) {
    auto r = SafetensorsFile::open(path);
    PD_CHECK_MSG(r.ok(), "cannot open golden file");
    return std::move(r).value();
  }
  SafetensorsFile file_;
};

inline double maxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  }
  return m;
}

inline void expectClose(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
  const double d = maxAbsDiff(got, want);
  std::printf("  [prefill] %-44s max|diff| = %.3g (tolerance %.0e)\n", what.c_str(), d, kStateTol);
  EXPECT_LE(d, kStateTol) << what;
}

}  // namespace pd::prefill::testsupport
