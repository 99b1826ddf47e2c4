// Fuzz target: the frame parser (clear and sealed) and the abort notice parser, fed hostile bytes.
// The first input byte picks the target (0: clear frames, 1: sealed frames, 2: abort notice) and how the
// rest is cut into feeds; the sealed parser opens with FUZZ_KEY (scripts/native_corpus.py seals with it).
// Built with clang -fsanitize=fuzzer (libFuzzer), or with fuzz_main.cpp under g++ (scripts/native_fuzz.sh).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "abort_notice.h"
#include "wire.h"

namespace {

const uint8_t FUZZ_KEY[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                              16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
constexpr uint64_t FUZZ_MAX_MESSAGE = 4 << 20;  // what the parser may be asked to hold at most

// Takes every frame (alternately holding one back once, as backpressure does) and checks the abort body.
class Sink : public zen::FrameSink {
 public:
  zen::Admit on_head(const zen::Header& h, const std::string&, uint8_t** dest, std::string*) override {
    if (h.kind == zen::DATA && (held_ ^= true)) return zen::Admit::Hold;
    if (h.size % 3 == 2) return zen::Admit::Discard;
    buf_.resize(h.size);  // bounded: the parser checked the size against FUZZ_MAX_MESSAGE first
    *dest = buf_.data();
    return zen::Admit::Take;
  }
  void on_frame(const zen::Header& h, const std::string&, bool taken, std::string* error) override {
    if (h.kind == zen::ABORT && taken) {
      std::string code, reason;
      if (!zen::parse_abort_notice(buf_.data(), buf_.size(), &code, &reason)) *error = "malformed abort";
    }
  }

 private:
  std::vector<uint8_t> buf_;
  bool held_ = false;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  uint8_t mode = data[0] % 3, cut = static_cast<uint8_t>(data[0] / 3);
  const uint8_t* p = data + 1;
  size_t n = size - 1;
  if (mode == 2) {
    std::string code, reason;
    if (zen::parse_abort_notice(p, n, &code, &reason)) {
      std::string again = zen::build_abort_notice(code, reason);  // what we build we parse back
      std::string code2, reason2;
      if (!zen::parse_abort_notice(reinterpret_cast<const uint8_t*>(again.data()), again.size(), &code2, &reason2)) {
        __builtin_trap();
      }
      (void)zen::valid_abort_code(code);
    }
    return 0;
  }
  zen::FrameParser parser(FUZZ_MAX_MESSAGE, mode == 1 ? FUZZ_KEY : nullptr);
  Sink sink;
  size_t step = cut ? cut : n;  // feeds of `cut` bytes: every split point of a frame gets exercised
  size_t at = 0;
  while (at < n && !parser.failed()) {
    size_t len = std::min(step, n - at);
    size_t used = parser.feed(p + at, len, sink);
    at += used;
    if (used == 0 && !parser.failed()) parser.feed(nullptr, 0, sink);  // held: ask again, as the engine does
  }
  return 0;
}
