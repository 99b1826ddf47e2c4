// Memory blocks reused by size class (receive_pool.py's role): received payloads and outgoing frames
// come back here when freed, so a steady stream of big messages does not page-fault fresh memory each time.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace zen {

// One block, owned: given back to the pool when destroyed.
class Block {
 public:
  Block() = default;
  explicit Block(size_t size);
  ~Block();
  Block(Block&& other) noexcept;
  Block& operator=(Block&& other) noexcept;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void release();
  uint8_t* data_ = nullptr;
  size_t size_ = 0, capacity_ = 0;
};

// Process-wide (a Message may outlive its engine). Its mutex is a leaf lock: nothing is taken under it.
class BufferPool {
 public:
  static constexpr size_t MIN_POOLED = 64 << 10;  // smaller blocks: malloc does well by itself
  static constexpr size_t MAX_FREE = 256 << 20;   // free bytes kept at most; beyond, blocks are freed
  static BufferPool& instance();
  uint8_t* take(size_t size, size_t* capacity);
  void give(uint8_t* data, size_t capacity);

  // receive_pool.py's PoolStats: blocks reused, blocks made, small ones not pooled, bytes of pooled blocks
  struct Counts {
    uint64_t reused = 0, allocated = 0, unpooled = 0, pooled_bytes = 0;
  };
  Counts counts();

 private:
  std::mutex mu_;
  std::map<size_t, std::vector<uint8_t*>> free_;  // by capacity
  size_t free_bytes_ = 0;
  Counts counts_;  // under mu_
};

}  // namespace zen
