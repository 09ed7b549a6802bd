#include "cli.h"
namespace pd::cli {
int runInspect(const std::vector<std::string>&) { return 3; }
}
