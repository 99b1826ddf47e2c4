// Python-style text for messages that must read like the Python transport's (repr, %g, float repr).
#pragma once
#include <cstdint>
#include <string>

namespace zen {

// repr() of a str given as UTF-8, cut to its first `max_chars` code points first (Python's s[:n]!r).
std::string py_repr(const std::string& utf8, size_t max_chars = SIZE_MAX);
// repr() of bytes (b'...').
std::string py_bytes_repr(const uint8_t* data, size_t len);
// repr() of a float (shortest round-trip form, "2.0" not "2").
std::string py_float(double value);
// Python's format(value, "g") and format(value, ".1f").
std::string fmt_g(double value);
std::string fmt_1f(double value);
// The first `max_chars` code points of a UTF-8 string.
std::string utf8_prefix(const std::string& utf8, size_t max_chars);
// Whether bytes are valid UTF-8 (what Python's bytes.decode() accepts).
bool valid_utf8(const uint8_t* data, size_t len);

}  // namespace zen
