#include "pd/common/result.h"

#include <cstdio>
#include <cstdlib>

namespace pd {

std::string_view errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::InvalidArgument:
      return "InvalidArgument";
    case ErrorCode::NotFound:
      return "NotFound";
    case ErrorCode::Io:
      return "Io";
    case ErrorCode::Corrupt:
      return "Corrupt";
    case ErrorCode::Unsupported:
      return "Unsupported";
    case ErrorCode::Timeout:
      return "Timeout";
    case ErrorCode::PeerFailed:
      return "PeerFailed";
    case ErrorCode::Cancelled:
      return "Cancelled";
    case ErrorCode::Overloaded:
      return "Overloaded";
    case ErrorCode::ResourceExhausted:
      return "ResourceExhausted";
    case ErrorCode::Internal:
      return "Internal";
    case ErrorCode::Unauthenticated:
      return "Unauthenticated";
  }
  return "Unknown";
}

std::string Error::toString() const {
  std::string out(errorCodeName(code));
  out += ": ";
  out += message;
  return out;
}

namespace detail {
void checkFailed(const char* file, int line, const char* condition, const char* message) {
  std::fprintf(stderr, "PD_CHECK failed at %s:%d: %s%s%s\n", file, line, condition, message != nullptr ? ": " : "",
               message != nullptr ? message : "");
  std::fflush(stderr);
  std::abort();
}
}  // namespace detail

}  // namespace pd
