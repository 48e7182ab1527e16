// SAPIPE_CHECK: TORCH_CHECK with a message this extension builds as one std::string.
//
// TORCH_CHECK given several message parts streams them into an std::ostringstream
// instantiated in this extension. On a CUDA image's torch (2.11.0+cu130, an H200 machine)
// inserting an integer into that stream crashed the interpreter (SIGSEGV) instead of raising
// the error. A single std::string part is passed through untouched, so the checks here
// concatenate their message themselves: numbers through std::to_string, dtypes and devices
// through c10's own names. Nothing is built unless the check fails.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace sapipe::check_detail {

inline std::string text(const char* s) { return s; }
inline std::string text(const std::string& s) { return s; }
inline std::string text(c10::ScalarType t) { return c10::toString(t); }
inline std::string text(const c10::Device& d) { return d.str(); }

template <class T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>, int> = 0>
std::string text(T v) {
  if constexpr (std::is_enum_v<T>) return std::to_string(static_cast<std::underlying_type_t<T>>(v));
  else return std::to_string(v);
}

template <class... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  ((s += text(parts)), ...);
  return s;
}

}  // namespace sapipe::check_detail

#define SAPIPE_CHECK(cond, ...) TORCH_CHECK(cond, ::sapipe::check_detail::message(__VA_ARGS__))
