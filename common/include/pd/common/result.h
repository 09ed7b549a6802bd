#pragma once
/// pdserve's single error policy (docs/errors.md):
///  - broken invariants (programming errors) -> PD_CHECK, which aborts with file:line;
///  - expected failures (bad input, peer gone, timeout, pool full) -> Result<T>.
/// Thread rules: values; no shared state.

#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "pd/common/check.h"

namespace pd {

/// The one error code enum of the project. Keep it small: a code says what the caller can do
/// about the failure (retry, report as 4xx, give up); the message says what happened.
enum class ErrorCode {
  InvalidArgument,    ///< the caller's input is wrong (bad request, bad flag, bad config value)
  NotFound,           ///< a named file, tensor, request or peer does not exist
  Io,                 ///< the operating system refused an operation (open, mmap, read, write)
  Corrupt,            ///< stored data is malformed or truncated (checkpoint, wire message)
  Unsupported,        ///< well-formed but not something this build can do (dtype, no GPU)
  Timeout,            ///< a deadline expired
  PeerFailed,         ///< the remote side of a transfer or connection failed or vanished
  Cancelled,          ///< the operation was aborted on purpose
  Overloaded,         ///< temporarily out of capacity; retrying later may succeed
  ResourceExhausted,  ///< can never fit (request larger than the whole pool)
  Internal,           ///< a bug surfaced as an error where aborting would lose more
  Unauthenticated,    ///< an internal call or message without a valid signature (docs/security.md)
};

std::string_view errorCodeName(ErrorCode code);

/// An expected failure: a code and a human-readable message naming what failed.
struct Error {
  ErrorCode code;
  std::string message;

  /// "Corrupt: model.safetensors: tensor 'x' ..."
  [[nodiscard]] std::string toString() const;
};

[[nodiscard]] inline Error makeError(ErrorCode code, std::string message) {
  return Error{code, std::move(message)};
}

/// Either a value or an Error. Cheap to move; inspect with ok() before value().
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::in_place_index<0>, std::move(value)) {}      // NOLINT(google-explicit-constructor)
  Result(Error error) : state_(std::in_place_index<1>, std::move(error)) {}  // NOLINT(google-explicit-constructor)

  [[nodiscard]] bool ok() const { return state_.index() == 0; }
  explicit operator bool() const { return ok(); }

  [[nodiscard]] T& value() & {
    PD_CHECK_MSG(ok(), "Result::value() on an error");
    return std::get<0>(state_);
  }
  [[nodiscard]] const T& value() const& {
    PD_CHECK_MSG(ok(), "Result::value() on an error");
    return std::get<0>(state_);
  }
  [[nodiscard]] T&& value() && {
    PD_CHECK_MSG(ok(), "Result::value() on an error");
    return std::get<0>(std::move(state_));
  }
  [[nodiscard]] const Error& error() const& {
    PD_CHECK_MSG(!ok(), "Result::error() on a value");
    return std::get<1>(state_);
  }
  [[nodiscard]] Error&& error() && {
    PD_CHECK_MSG(!ok(), "Result::error() on a value");
    return std::get<1>(std::move(state_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Error> state_;
};

/// Result<void>: success or an Error.
template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT(google-explicit-constructor)

  [[nodiscard]] bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  [[nodiscard]] const Error& error() const& {
    PD_CHECK_MSG(!ok_, "Result::error() on success");
    return error_;
  }
  [[nodiscard]] Error&& error() && {
    PD_CHECK_MSG(!ok_, "Result::error() on success");
    return std::move(error_);
  }

 private:
  Error error_{ErrorCode::Internal, {}};
  bool ok_ = true;
};

using Status = Result<void>;

[[nodiscard]] inline Status okStatus() {
  return {};
}

}  // namespace pd

/// Propagates an error from an expression returning Result<...>.
#define PD_TRY(expr)                            \
  do {                                          \
    auto pd_try_result_ = (expr);               \
    if (!pd_try_result_.ok()) {                 \
      return std::move(pd_try_result_).error(); \
    }                                           \
  } while (false)

#define PD_CONCAT_INNER_(a, b) a##b
#define PD_CONCAT_(a, b) PD_CONCAT_INNER_(a, b)

/// `PD_ASSIGN_OR_RETURN(auto x, makeX());` declares x from the value or returns the error.
#define PD_ASSIGN_OR_RETURN(decl, expr)                                \
  auto PD_CONCAT_(pd_assign_result_, __LINE__) = (expr);               \
  if (!PD_CONCAT_(pd_assign_result_, __LINE__).ok()) {                 \
    return std::move(PD_CONCAT_(pd_assign_result_, __LINE__)).error(); \
  }                                                                    \
  decl = std::move(PD_CONCAT_(pd_assign_result_, __LINE__)).value()  // NOLINT(bugprone-macro-parentheses)
