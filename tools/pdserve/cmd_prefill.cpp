// pdserve prefill: the prefill process (not built yet).
#include <cstdio>

#include "cli.h"

namespace pd::cli {

int runPrefill(const std::vector<std::string>& /*args*/) {
  std::fprintf(stderr, "pdserve prefill: not built yet\n");
  return 3;
}

}  // namespace pd::cli
