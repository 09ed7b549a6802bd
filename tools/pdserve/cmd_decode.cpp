// pdserve decode: the decode process (not built yet).
#include <cstdio>

#include "cli.h"

namespace pd::cli {

int runDecode(const std::vector<std::string>& /*args*/) {
  std::fprintf(stderr, "pdserve decode: not built yet\n");
  return 3;
}

}  // namespace pd::cli
