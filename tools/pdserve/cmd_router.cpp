// pdserve router: the router process (not built yet).
#include <cstdio>

#include "cli.h"

namespace pd::cli {

int runRouter(const std::vector<std::string>& /*args*/) {
  std::fprintf(stderr, "pdserve router: not built yet\n");
  return 3;
}

}  // namespace pd::cli
