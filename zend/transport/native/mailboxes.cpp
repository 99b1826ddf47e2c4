#include "mailboxes.h"

namespace zen {

bool Mailboxes::deliver(int src, const std::string& tag, MessagePtr msg) {
  if (voided(tag)) {
    ++dropped;
    return false;
  }
  buffered_[static_cast<size_t>(src)] += msg->size();
  boxes_[{src, tag}].push_back(std::move(msg));
  return true;
}

MessagePtr Mailboxes::take(int src, const std::string& tag) {
  auto it = boxes_.find({src, tag});
  if (it == boxes_.end()) return nullptr;
  MessagePtr msg = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) boxes_.erase(it);
  buffered_[static_cast<size_t>(src)] -= msg->size();
  return msg;
}

bool Mailboxes::holds(int src, const std::string& prefix) const {
  // boxes are ordered by (source, tag) and erased once empty: the first at or after (src, prefix) decides
  auto it = boxes_.lower_bound({src, prefix});
  return it != boxes_.end() && it->first.first == src && it->first.second.compare(0, prefix.size(), prefix) == 0;
}

bool Mailboxes::must_wait(int src, uint64_t size, uint64_t max_buffered) const {
  uint64_t held = buffered_[static_cast<size_t>(src)];
  return held != 0 && held + size > max_buffered;
}

uint64_t Mailboxes::buffered(int src) const {
  if (src >= 0) return static_cast<size_t>(src) < buffered_.size() ? buffered_[static_cast<size_t>(src)] : 0;
  uint64_t total = 0;
  for (uint64_t b : buffered_) total += b;
  return total;
}

bool Mailboxes::void_prefix(const std::string& prefix, const std::string& code, const std::string& reason) {
  if (aborted_.count(prefix)) return false;
  aborted_[prefix] = AbortInfo{code, reason};
  order_.push_back(prefix);
  while (order_.size() > MAX_ABORTED_PREFIXES) {
    aborted_.erase(order_.front());
    order_.pop_front();
  }
  for (auto it = boxes_.begin(); it != boxes_.end();) {
    if (it->first.second.compare(0, prefix.size(), prefix) == 0) {
      for (auto& m : it->second) buffered_[static_cast<size_t>(it->first.first)] -= m->size();
      dropped += it->second.size();
      it = boxes_.erase(it);
    } else {
      ++it;
    }
  }
  return true;
}

std::optional<AbortInfo> Mailboxes::voided(const std::string& tag) const {
  if (aborted_.empty()) return std::nullopt;
  // one lookup per '/' of the tag (prefixes end at a '/'), however many steps were voided
  for (size_t end = tag.find('/'); end != std::string::npos; end = tag.find('/', end + 1)) {
    auto it = aborted_.find(tag.substr(0, end + 1));
    if (it != aborted_.end()) return it->second;
  }
  return std::nullopt;
}

std::vector<std::pair<std::string, AbortInfo>> Mailboxes::recent_aborts(size_t count) const {
  std::vector<std::pair<std::string, AbortInfo>> out;
  size_t skip = order_.size() > count ? order_.size() - count : 0;
  for (const auto& prefix : order_) {
    if (skip) { --skip; continue; }
    out.emplace_back(prefix, aborted_.at(prefix));
  }
  return out;
}

}  // namespace zen
