#include "abort_notice.h"

#include <cstdio>

#include "text.h"
#include "wire.h"

namespace zen {
namespace {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// A JSON string as json.dumps(ensure_ascii=True) writes it.
void json_string(std::string& out, const std::string& utf8) {
  out += '"';
  char buf[16];
  const auto* p = reinterpret_cast<const uint8_t*>(utf8.data());
  size_t i = 0, n = utf8.size();
  while (i < n) {
    uint32_t cp = p[i];
    size_t extra = cp < 0x80 ? 0 : cp < 0xE0 ? 1 : cp < 0xF0 ? 2 : 3;
    if (extra) {
      cp &= extra == 1 ? 0x1F : extra == 2 ? 0x0F : 0x07;
      for (size_t k = 1; k <= extra && i + k < n; ++k) cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    i += extra + 1;
    if (cp == '"') out += "\\\"";
    else if (cp == '\\') out += "\\\\";
    else if (cp == '\n') out += "\\n";
    else if (cp == '\r') out += "\\r";
    else if (cp == '\t') out += "\\t";
    else if (cp == '\b') out += "\\b";
    else if (cp == '\f') out += "\\f";
    else if (cp < 0x20 || (cp >= 0x7f && cp < 0x10000)) {
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      out += buf;
    } else if (cp >= 0x10000) {
      uint32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      out += buf;
    } else {
      out += static_cast<char>(cp);
    }
  }
  out += '"';
}

struct Reader {
  const uint8_t* p;
  size_t n, i = 0;
  void ws() {
    while (i < n && (p[i] == ' ' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r')) ++i;
  }
  bool eat(char c) {
    ws();
    if (i < n && p[i] == c) { ++i; return true; }
    return false;
  }
  bool hex4(uint32_t* v) {
    if (n - i < 4) return false;
    *v = 0;
    for (int k = 0; k < 4; ++k) {
      uint8_t c = p[i++];
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) return false;
      *v = (*v << 4) | static_cast<uint32_t>(d);
    }
    return true;
  }
  bool string(std::string* out) {
    if (!eat('"')) return false;
    size_t start = i;
    while (i < n) {
      uint8_t c = p[i];
      if (c == '"') { ++i; return valid_utf8(reinterpret_cast<const uint8_t*>(out->data()), out->size()); }
      if (c < 0x20) return false;
      if (c != '\\') { *out += static_cast<char>(c); ++i; continue; }
      if (++i >= n) return false;
      c = p[i++];
      switch (c) {
        case '"': *out += '"'; break;
        case '\\': *out += '\\'; break;
        case '/': *out += '/'; break;
        case 'b': *out += '\b'; break;
        case 'f': *out += '\f'; break;
        case 'n': *out += '\n'; break;
        case 'r': *out += '\r'; break;
        case 't': *out += '\t'; break;
        case 'u': {
          uint32_t cp;
          if (!hex4(&cp)) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a high surrogate must pair with a low one
            uint32_t lo;
            if (n - i < 6 || p[i] != '\\' || p[i + 1] != 'u') return false;
            i += 2;
            if (!hex4(&lo) || lo < 0xDC00 || lo > 0xDFFF) return false;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return false;
          }
          append_utf8(*out, cp);
          break;
        }
        default: return false;
      }
    }
    (void)start;
    return false;
  }
};

}  // namespace

std::string build_abort_notice(const std::string& code, const std::string& reason) {
  std::string out = "{\"code\": ";
  json_string(out, utf8_prefix(code, 64));
  out += ", \"reason\": ";
  json_string(out, utf8_prefix(reason, MAX_ABORT_BYTES - 128));
  out += "}";
  if (out.size() > MAX_ABORT_BYTES) out.resize(MAX_ABORT_BYTES);  // as Python's text[:MAX_ABORT_BYTES]
  return out;
}

bool parse_abort_notice(const uint8_t* data, size_t len, std::string* code, std::string* reason) {
  Reader r{data, len};
  bool have_code = false, have_reason = false;
  if (!r.eat('{')) return false;
  if (!r.eat('}')) {
    do {
      std::string key, value;
      if (!r.string(&key) || !r.eat(':') || !r.string(&value)) return false;
      if (key == "code") { *code = value; have_code = true; }
      else if (key == "reason") { *reason = value; have_reason = true; }
    } while (r.eat(','));
    if (!r.eat('}')) return false;
  }
  r.ws();
  return r.i == len && have_code && have_reason;
}

bool valid_abort_code(const std::string& code) {
  if (code.empty() || code.size() > 32) return false;
  bool letter = false;
  for (char c : code) {
    if (c >= 'A' && c <= 'Z') letter = true;
    else if (c != '_') return false;
  }
  return letter;
}

}  // namespace zen
