#include "wire.h"

#include <algorithm>
#include <cstring>

#include "text.h"

namespace zen {

const char* const HEAD_AUTH_ERROR =
    "sent a frame that failed authentication (tampered, replayed, reordered or not from this link's peer)";
const char* const RECORD_AUTH_ERROR = "sent a payload that failed authentication (tampered, replayed or reordered)";

namespace {
const uint8_t MAGIC[4] = {'Z', 'E', 'N', 'T'};

void put_le(uint8_t* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_le(const uint8_t* in, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | in[i];
  return v;
}
}  // namespace

void pack_header(uint8_t out[HEADER_BYTES], uint8_t kind, uint32_t tag_len, uint64_t size) {
  std::memcpy(out, MAGIC, 4);
  out[4] = FRAME_VERSION;
  out[5] = kind;
  out[6] = out[7] = 0;
  put_le(out + 8, tag_len, 4);
  put_le(out + 12, size, 8);
}

bool unpack_header(const uint8_t in[HEADER_BYTES], Header* h, std::string* error) {
  h->kind = in[5];
  h->tag_len = static_cast<uint32_t>(get_le(in + 8, 4));
  h->size = get_le(in + 12, 8);
  uint8_t version = in[4];
  bool kind_ok = h->kind >= DATA && h->kind <= ABORT;
  if (std::memcmp(in, MAGIC, 4) != 0 || version != FRAME_VERSION || !kind_ok || h->tag_len > MAX_TAG_BYTES) {
    *error = "sent a malformed frame (magic " + py_bytes_repr(in, 4) + ", version " + std::to_string(version) +
             ", type " + std::to_string(h->kind) + ", tag of " + std::to_string(h->tag_len) + " bytes)";
    return false;
  }
  bool bare = h->kind == HEARTBEAT || h->kind == GOODBYE;
  if ((bare && (h->tag_len || h->size)) || (h->kind == ABORT && h->size > MAX_ABORT_BYTES)) {
    *error = "sent a malformed control frame (type " + std::to_string(h->kind) + ", tag of " +
             std::to_string(h->tag_len) + " bytes, " + std::to_string(h->size) + " bytes)";
    return false;
  }
  return true;
}

uint64_t frame_size(bool sealed, size_t tag_len, uint64_t size) {
  return sealed ? HEADER_BYTES + tag_len + GCM_TAG + sealed_size(size) : HEADER_BYTES + tag_len + size;
}

bool build_frame(Sealer* sealer, uint8_t kind, const std::string& tag, const uint8_t* payload, uint64_t size,
                 uint8_t* out) {
  pack_header(out, kind, static_cast<uint32_t>(tag.size()), size);
  uint8_t* p = out + HEADER_BYTES;
  if (sealer == nullptr) {
    std::memcpy(p, tag.data(), tag.size());
    if (size) std::memcpy(p + tag.size(), payload, size);
    return true;
  }
  if (!sealer->seal(reinterpret_cast<const uint8_t*>(tag.data()), tag.size(), out, HEADER_BYTES, p)) return false;
  return sealer->seal_payload(payload, size, p + tag.size() + GCM_TAG);
}

FrameParser::FrameParser(uint64_t max_message_bytes, const uint8_t* recv_key)
    : max_message_bytes_(max_message_bytes), opener_(recv_key ? new Opener(recv_key) : nullptr) {}

void FrameParser::fail(const std::string& why) {
  if (error_.empty()) error_ = why;
}

void FrameParser::header_done() {
  std::string why;
  if (!unpack_header(head_bytes_, &head_, &why)) return fail(why);
  state_ = State::Tag;
  got_ = 0;
  if (head_.tag_len == 0 && !opener_) tag_done();  // nothing more to wait for before admission
}

void FrameParser::tag_done() {
  // Sealed: the tag authenticates the header too, before anything the header announces is believed.
  size_t len = head_.tag_len;
  if (opener_) {
    if (!opener_->open(tag_wire_, len, head_bytes_, HEADER_BYTES, tag_wire_)) return fail(HEAD_AUTH_ERROR);
  }
  if (!valid_utf8(tag_wire_, len)) return fail("disconnected: its frame's tag is not UTF-8");
  tag_.assign(reinterpret_cast<const char*>(tag_wire_), len);
  if (head_.kind == DATA && head_.size > max_message_bytes_) {
    return fail("announced a message of " + std::to_string(head_.size) + " bytes, over the " +
                std::to_string(max_message_bytes_) + "-byte limit");
  }
  state_ = State::Admit;
}

void FrameParser::admit(FrameSink& sink) {
  std::string why;
  uint8_t* dest = nullptr;
  Admit a = sink.on_head(head_, tag_, &dest, &why);
  if (!why.empty()) return fail(why);
  if (a == Admit::Hold) return;
  taken_ = a == Admit::Take;
  dest_ = taken_ ? dest : nullptr;
  done_ = 0;
  got_ = 0;
  if (head_.size == 0) return finish(sink);
  if (opener_) {
    if (!record_) record_.reset(new uint8_t[CHUNK + GCM_TAG]);
    record_len_ = std::min<uint64_t>(CHUNK, head_.size) + GCM_TAG;
  }
  state_ = State::Payload;
}

void FrameParser::finish(FrameSink& sink) {
  std::string why;
  state_ = State::Header;
  got_ = 0;
  sink.on_frame(head_, tag_, taken_, &why);
  if (!why.empty()) fail(why);
}

void FrameParser::record_done() {
  size_t plain = record_len_ - GCM_TAG;
  uint8_t* out = taken_ ? dest_ + done_ : record_.get();  // a discarded record is opened in place
  if (!opener_->open(record_.get(), plain, nullptr, 0, out)) return fail(RECORD_AUTH_ERROR);
  done_ += plain;
  got_ = 0;
  record_len_ = std::min<uint64_t>(CHUNK, head_.size - done_) + GCM_TAG;
}

std::pair<uint8_t*, size_t> FrameParser::direct() {
  if (state_ != State::Payload || failed()) return {nullptr, 0};
  if (opener_) return {record_.get() + got_, record_len_ - got_};
  if (!taken_) return {nullptr, 0};
  return {dest_ + done_, static_cast<size_t>(head_.size - done_)};
}

void FrameParser::payload_bytes(size_t n, FrameSink& sink) {
  if (opener_) {
    got_ += n;
    if (got_ == record_len_) record_done();
  } else {
    done_ += n;
  }
  if (!failed() && done_ == head_.size) finish(sink);
}

void FrameParser::commit(size_t n, FrameSink& sink) { payload_bytes(n, sink); }

size_t FrameParser::feed(const uint8_t* data, size_t len, FrameSink& sink) {
  size_t used = 0;
  while (!failed()) {
    if (state_ == State::Admit) {
      admit(sink);
      if (state_ == State::Admit) break;  // held
      continue;
    }
    if (used == len) break;
    size_t avail = len - used;
    if (state_ == State::Header) {
      size_t n = std::min(avail, HEADER_BYTES - got_);
      std::memcpy(head_bytes_ + got_, data + used, n);
      got_ += n;
      used += n;
      if (got_ == HEADER_BYTES) header_done();
    } else if (state_ == State::Tag) {
      size_t want = head_.tag_len + (opener_ ? GCM_TAG : 0);
      size_t n = std::min(avail, want - got_);
      std::memcpy(tag_wire_ + got_, data + used, n);
      got_ += n;
      used += n;
      if (got_ == want) tag_done();
    } else {  // Payload
      auto region = direct();
      size_t n;
      if (region.first != nullptr) {
        n = std::min(avail, region.second);
        std::memcpy(region.first, data + used, n);
      } else {  // clear and discarded: skip
        n = static_cast<size_t>(std::min<uint64_t>(avail, head_.size - done_));
      }
      used += n;
      payload_bytes(n, sink);
    }
  }
  return used;
}

}  // namespace zen
