#include "text.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace zen {

std::string utf8_prefix(const std::string& s, size_t max_chars) {
  size_t chars = 0, i = 0;
  while (i < s.size()) {
    if ((static_cast<uint8_t>(s[i]) & 0xC0) != 0x80) {  // a code point starts here
      if (chars == max_chars) break;
      ++chars;
    }
    ++i;
  }
  return s.substr(0, i);
}

std::string py_repr(const std::string& utf8, size_t max_chars) {
  std::string s = utf8_prefix(utf8, max_chars);
  bool single = s.find('\'') == std::string::npos || s.find('"') != std::string::npos;
  char quote = single ? '\'' : '"';
  std::string out(1, quote);
  char buf[8];
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(quote)) { out += '\\'; out += quote; }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) { std::snprintf(buf, sizeof buf, "\\x%02x", c); out += buf; }
    else out += static_cast<char>(c);  // printable ASCII and UTF-8 bytes as they are
  }
  out += quote;
  return out;
}

std::string py_bytes_repr(const uint8_t* data, size_t len) {
  std::string out = "b'";
  char buf[8];
  for (size_t i = 0; i < len; ++i) {
    uint8_t c = data[i];
    if (c == '\\' || c == '\'') { out += '\\'; out += static_cast<char>(c); }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c >= 0x7f) { std::snprintf(buf, sizeof buf, "\\x%02x", c); out += buf; }
    else out += static_cast<char>(c);
  }
  return out + "'";
}

std::string py_float(double v) {
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {  // shortest form that reads back as the same double
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (std::isfinite(v) && s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string fmt_g(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string fmt_1f(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

bool valid_utf8(const uint8_t* p, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = p[i];
    size_t extra;
    uint32_t cp;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { extra = 1; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { extra = 2; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { extra = 3; cp = c & 0x07; }
    else return false;
    if (i + extra >= n) return false;
    for (size_t k = 1; k <= extra; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    // no overlong forms, no surrogates, nothing past U+10FFFF (as Python's strict decoder)
    if ((extra == 1 && cp < 0x80) || (extra == 2 && cp < 0x800) || (extra == 3 && cp < 0x10000)) return false;
    if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return false;
    i += extra + 1;
  }
  return true;
}

}  // namespace zen
