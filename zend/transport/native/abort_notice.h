// An abort frame's body: {"code": ..., "reason": ...} as Python's json.dumps writes it (link_transport.py).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace zen {

// The body for (code, reason), UTF-8 in: code cut to 64 and reason to 3968 code points, ASCII out
// (json.dumps' ensure_ascii), at most 4096 bytes.
std::string build_abort_notice(const std::string& code, const std::string& reason);
// Parses a body: a JSON object whose "code" and "reason" are strings (other string members are
// ignored); escapes \" \\ \/ \b \f \n \r \t \uXXXX (surrogate pairs joined) become UTF-8. False on
// anything else.
bool parse_abort_notice(const uint8_t* data, size_t len, std::string* code, std::string* reason);
// The code rule of an abort received: uppercase letters and underscores, a letter at least, <= 32.
bool valid_abort_code(const std::string& code);

}  // namespace zen
