#pragma once
// The first golden prompt of a golden checkpoint (tests/data/golden/<model>/golden.json): its
// token ids and the reference's greedy continuation, for end-to-end tests through pdserve up.

#include <boost/json.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "support/test_files.h"

namespace pd::test {

struct GoldenPrompt {
  std::vector<std::int64_t> tokens;
  std::vector<std::int64_t> greedy;
};

inline GoldenPrompt goldenPrompt(const std::string& model) {
  const auto doc = boost::json::parse(readFile(goldenDir() / model / "golden.json"));
  const auto& p = doc.at("prompts").as_array().at(0).as_object();
  GoldenPrompt g;
  for (const auto& t : p.at("tokens").as_array()) g.tokens.push_back(t.to_number<std::int64_t>());
  for (const auto& t : p.at("greedy").as_array()) g.greedy.push_back(t.to_number<std::int64_t>());
  return g;
}

}  // namespace pd::test
