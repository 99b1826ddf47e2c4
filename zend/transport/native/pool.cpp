#include "pool.h"

#include <cstdlib>
#include <new>

namespace zen {

namespace {
// Eight classes per power of two: a block is at most 12.5% bigger than asked.
size_t size_class(size_t size) {
  size_t top = 1;
  while (top * 2 <= size) top *= 2;
  size_t step = top / 8 ? top / 8 : 1;
  return (size + step - 1) / step * step;
}
}  // namespace

BufferPool& BufferPool::instance() {
  static BufferPool* pool = new BufferPool();  // never destroyed: Messages may be freed at exit
  return *pool;
}

uint8_t* BufferPool::take(size_t size, size_t* capacity) {
  size_t cap = size < MIN_POOLED ? (size ? size : 1) : size_class(size);
  *capacity = cap;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (cap < MIN_POOLED) {
      counts_.unpooled++;
    } else {
      auto it = free_.find(cap);
      if (it != free_.end() && !it->second.empty()) {
        uint8_t* p = it->second.back();
        it->second.pop_back();
        free_bytes_ -= cap;
        counts_.reused++;
        return p;
      }
      counts_.allocated++;
      counts_.pooled_bytes += cap;
    }
  }
  // malloc, not new[]: nothing zeroes memory that the payload overwrites at once
  auto* p = static_cast<uint8_t*>(std::malloc(cap));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void BufferPool::give(uint8_t* data, size_t capacity) {
  if (capacity >= MIN_POOLED) {
    std::lock_guard<std::mutex> lk(mu_);
    if (free_bytes_ + capacity <= MAX_FREE) {
      free_[capacity].push_back(data);
      free_bytes_ += capacity;
      return;
    }
    counts_.pooled_bytes -= capacity;  // freed, not kept
  }
  std::free(data);
}

BufferPool::Counts BufferPool::counts() {
  std::lock_guard<std::mutex> lk(mu_);
  return counts_;
}

// (in the body: capacity_'s default initializer would run after data_'s and forget the capacity)
Block::Block(size_t size) : size_(size) { data_ = BufferPool::instance().take(size, &capacity_); }
Block::~Block() { release(); }
Block::Block(Block&& other) noexcept : data_(other.data_), size_(other.size_), capacity_(other.capacity_) {
  other.data_ = nullptr;
}
Block& Block::operator=(Block&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    size_ = other.size_;
    capacity_ = other.capacity_;
    other.data_ = nullptr;
  }
  return *this;
}
void Block::release() {
  if (data_ != nullptr) BufferPool::instance().give(data_, capacity_);
  data_ = nullptr;
}

}  // namespace zen
