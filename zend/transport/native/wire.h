// Frames on the wire (frames.py, framing.py): the 20-byte header, its validation, and an incremental
// parser that opens sealed tags and records. Pure: no I/O, so the fuzzer drives it without sockets.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "seal.h"

namespace zen {

constexpr size_t HEADER_BYTES = 20;  // struct "<4sBBxxIQ": magic, version, kind, pad, tag length, size
constexpr uint8_t FRAME_VERSION = 1;
enum Kind : uint8_t { DATA = 1, GOODBYE = 2, HEARTBEAT = 3, ABORT = 4 };
constexpr uint32_t MAX_TAG_BYTES = 236;
constexpr uint64_t MAX_ABORT_BYTES = 4096;

struct Header {
  uint8_t kind = 0;
  uint32_t tag_len = 0;
  uint64_t size = 0;
};

void pack_header(uint8_t out[HEADER_BYTES], uint8_t kind, uint32_t tag_len, uint64_t size);
// Checks a header as frames.unpack_frame does; false with the FrameError's text in *error.
bool unpack_header(const uint8_t in[HEADER_BYTES], Header* out, std::string* error);

// A whole frame as it goes on the wire (header, tag, payload; sealed when `sealer` is set), into one
// buffer of frame_size() bytes. The tag must be at most MAX_TAG_BYTES (the caller checks).
uint64_t frame_size(bool sealed, size_t tag_len, uint64_t size);
bool build_frame(Sealer* sealer, uint8_t kind, const std::string& tag, const uint8_t* payload, uint64_t size,
                 uint8_t* out);

extern const char* const HEAD_AUTH_ERROR;
extern const char* const RECORD_AUTH_ERROR;

// What the parser's owner decides for a frame whose header is valid and whose tag is open.
enum class Admit { Take, Discard, Hold };

class FrameSink {
 public:
  virtual ~FrameSink() = default;
  // Take: *dest gets `size` bytes of payload (nullptr allowed when size is 0). Discard: the payload is
  // read (sealed: opened) and dropped. Hold: ask again at the next feed (backpressure). A non-empty
  // *error drops the link.
  virtual Admit on_head(const Header& h, const std::string& tag, uint8_t** dest, std::string* error) = 0;
  // The frame is whole (its payload in *dest if taken). A non-empty *error drops the link.
  virtual void on_frame(const Header& h, const std::string& tag, bool taken, std::string* error) = 0;
};

class FrameParser {
 public:
  // keys null: a clear link. max_message_bytes bounds a DATA frame's announced size.
  FrameParser(uint64_t max_message_bytes, const uint8_t* recv_key);
  // Consumes bytes; returns how many it took (fewer when the sink holds a frame or on an error).
  size_t feed(const uint8_t* data, size_t len, FrameSink& sink);
  // Where the next bytes of a payload may be read straight into (clear: the message; sealed: the
  // record being gathered), or {nullptr, 0}. After reading n bytes there, call commit(n).
  std::pair<uint8_t*, size_t> direct();
  void commit(size_t n, FrameSink& sink);
  bool failed() const { return !error_.empty(); }
  const std::string& error() const { return error_; }
  bool held() const { return state_ == State::Admit; }
  // Bytes of the payload in progress (a big payload still arriving is life; tests).
  uint64_t payload_left() const { return state_ == State::Payload ? head_.size - done_ : 0; }

 private:
  enum class State { Header, Tag, Admit, Payload };
  void header_done();
  void tag_done();
  void admit(FrameSink& sink);
  void payload_bytes(size_t n, FrameSink& sink);  // n bytes landed in direct()'s region
  void record_done();
  void finish(FrameSink& sink);
  void fail(const std::string& why);

  uint64_t max_message_bytes_;
  std::unique_ptr<Opener> opener_;
  State state_ = State::Header;
  uint8_t head_bytes_[HEADER_BYTES];
  uint8_t tag_wire_[MAX_TAG_BYTES + GCM_TAG];
  size_t got_ = 0;  // bytes of the header, tag or record gathered so far
  Header head_;
  std::string tag_;
  uint8_t* dest_ = nullptr;
  bool taken_ = false;
  uint64_t done_ = 0;  // payload bytes complete (clear: landed; sealed: opened)
  std::unique_ptr<uint8_t[]> record_;  // sealed: one record (CHUNK + GCM_TAG), made on first use
  size_t record_len_ = 0;
  std::string error_;
};

}  // namespace zen
