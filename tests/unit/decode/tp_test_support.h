#pragma once
// Shared by the tensor-parallel tests: golden inputs, and one TP group's run of `generate`.

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "golden_support.h"
#include "pd/comm/communicator.h"
#include "pd/engine/engine.h"
#include "pd/engine/generate.h"
#include "pd/engine/tp_engine.h"

namespace pd::decode::test_support {

inline double maxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

inline std::unique_ptr<model::Engine> makeRankEngine(const std::filesystem::path& dir, comm::Communicator* tp) {
  model::CpuEngineOptions o;
  o.threads = 1;
  o.tp = tp;
  auto e = model::createCpuEngine(dir, o);
  PD_CHECK_MSG(e.ok(), "cannot create a tensor-parallel engine on the golden model");
  return std::move(e).value();
}

}  // namespace pd::decode::test_support
