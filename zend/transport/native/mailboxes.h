// Where received messages wait for their recv (mailboxes.py): by (source, tag), counted per source,
// voidable by tag prefix. Not locked itself: the Engine calls it under its state mutex.
#pragma once
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pool.h"

namespace zen {

constexpr size_t MAX_ABORTED_PREFIXES = 16384;  // voided steps remembered (a late message is dropped)

// One received payload, handed to Python as it is (buffer protocol, no copy); its block goes back to
// the pool when the last reference goes.
class Message {
 public:
  explicit Message(uint64_t size) : block_(static_cast<size_t>(size)) {}
  uint8_t* data() { return block_.data(); }
  uint64_t size() const { return block_.size(); }

 private:
  Block block_;
};
using MessagePtr = std::shared_ptr<Message>;

struct AbortInfo {
  std::string code, reason;
};

class Mailboxes {
 public:
  explicit Mailboxes(int world_size) : buffered_(static_cast<size_t>(world_size), 0) {}
  // A message from src: kept, or dropped (counted) if its tag was voided. False when dropped.
  bool deliver(int src, const std::string& tag, MessagePtr msg);
  // The next message of (src, tag), or null.
  MessagePtr take(int src, const std::string& tag);
  // Whether a message from src with a tag under `prefix` waits to be taken (a peer's later step).
  bool holds(int src, const std::string& prefix) const;
  // Whether a message of `size` bytes from src must wait for room (backpressure).
  bool must_wait(int src, uint64_t size, uint64_t max_buffered) const;
  uint64_t buffered(int src) const;  // -1: every source
  // Remembers prefix as voided, drops what its mailboxes hold. False if it was voided already.
  bool void_prefix(const std::string& prefix, const std::string& code, const std::string& reason);
  std::optional<AbortInfo> voided(const std::string& tag) const;
  // The last `count` voided prefixes, oldest first.
  std::vector<std::pair<std::string, AbortInfo>> recent_aborts(size_t count) const;
  uint64_t dropped = 0;  // messages of voided steps, dropped on arrival or from a mailbox

 private:
  std::map<std::pair<int, std::string>, std::deque<MessagePtr>> boxes_;
  std::vector<uint64_t> buffered_;
  std::list<std::string> order_;  // voided prefixes, oldest first
  std::unordered_map<std::string, AbortInfo> aborted_;
};

}  // namespace zen
