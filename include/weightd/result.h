// Errors as values. Every fallible weightd function returns a Result<T> (or a
// Status, which is Result<void>): either the value or an Error carrying a
// message a person can act on ("model-00001.safetensors: tensor `w`: offsets
// must be contiguous and non-overlapping"). Exceptions never cross a weightd
// API; the CLI is the only place that turns errors into exit codes.
//
// Result objects are plain values: not thread-safe to mutate concurrently,
// safe to read from several threads.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace weightd {

class Error {
 public:
  explicit Error(std::string message) : message_(std::move(message)) {}

  const std::string& message() const { return message_; }

  // Returns a copy with `context: ` put in front, for callers that add what
  // they were doing ("reading index: ..." ).
  Error WithContext(const std::string& context) const { return Error(context + ": " + message_); }

 private:
  std::string message_;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}      // NOLINT: implicit by design
  Result(Error error) : state_(std::move(error)) {}  // NOLINT: implicit by design

  bool ok() const { return state_.index() == 0; }
  explicit operator bool() const { return ok(); }

  // REQUIRES: ok()
  T& value() & {
    assert(ok());
    return std::get<0>(state_);
  }
  const T& value() const& {
    assert(ok());
    return std::get<0>(state_);
  }
  T&& value() && {
    assert(ok());
    return std::get<0>(std::move(state_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

  // REQUIRES: !ok()
  const Error& error() const {
    assert(!ok());
    return std::get<1>(state_);
  }

 private:
  std::variant<T, Error> state_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT: implicit by design

  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }

  // REQUIRES: !ok()
  const Error& error() const {
    assert(!ok_);
    return error_;
  }

 private:
  Error error_{""};
  bool ok_ = true;
};

using Status = Result<void>;

inline Status OkStatus() { return Status(); }

}  // namespace weightd

#define WEIGHTD_CONCAT_INNER(a, b) a##b
#define WEIGHTD_CONCAT(a, b) WEIGHTD_CONCAT_INNER(a, b)

// Returns the error of a Status- or Result-valued expression from the
// enclosing function.
#define WEIGHTD_RETURN_IF_ERROR(expr) \
  do {                                \
    auto weightd_status_ = (expr);    \
    if (!weightd_status_.ok()) {      \
      return weightd_status_.error(); \
    }                                 \
  } while (false)

// `WEIGHTD_ASSIGN_OR_RETURN(auto x, Compute());` declares x with the value, or
// returns the error from the enclosing function.
#define WEIGHTD_ASSIGN_OR_RETURN(lhs, expr) \
  WEIGHTD_ASSIGN_OR_RETURN_IMPL(WEIGHTD_CONCAT(weightd_result_, __LINE__), lhs, expr)
#define WEIGHTD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) {                                    \
    return tmp.error();                               \
  }                                                   \
  lhs = std::move(tmp).value()
