// The Engine: a rank's links to its peers, one epoll I/O thread, mailboxes, liveness and events.
//
// Threads: Python threads call send/recv/abort/attach/... with the GIL released; one I/O thread
// reads every link (parse, open, admit, deliver), drains what senders could not write at once, and
// keeps time (heartbeats, watchdog, our own stalls). Sealing happens on the sending thread.
//
// Locks (taken in this order, never the other way):
//   Peer::send_mu  orders what goes on a peer's current link: sealing (the record numbers) and
//                  queueing of one frame at a time. Held by senders, attach (abort replay), close
//                  (goodbye); the I/O thread only try_locks it (heartbeats).
//   mu_            the engine's state: peers' link/serial/error, the mailboxes, voided prefixes,
//                  admission table, events, stalls, closed_, the I/O thread's to-do lists. Never
//                  held across a system call that may block, nor across sealing or opening.
//   Link::out_mu   one link's send queue and its socket writes (non-blocking, short).
//   BufferPool's mutex (pool.h) is a leaf: taken under any of these, nothing under it.
// The I/O thread alone owns each link's parser, read staging and last_heard.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "admission.h"
#include "mailboxes.h"
#include "seal.h"
#include "wire.h"

namespace zen {

// A sender waits beyond this much queued for a peer (one frame of any size still goes on an empty queue):
// with the sockets' own buffers it bounds what a held-back receiver lets a sender run ahead by.
constexpr uint64_t MAX_QUEUED_BYTES = 8ull << 20;
constexpr size_t REPLAYED_ABORTS = 256;
constexpr size_t MAX_EVENTS = 4096;  // next_events' backlog (oldest dropped beyond)

// Errors a call raises to Python (bindings.cpp maps kind to the exception class).
struct EngineFailure {
  enum Kind { LinkDown, Aborted, Timeout, Closed, Value } kind;
  std::string message;
  std::string code, reason;  // Aborted
  EngineFailure(Kind k, std::string m, std::string c = {}, std::string r = {})
      : kind(k), message(std::move(m)), code(std::move(c)), reason(std::move(r)) {}
};

struct Event {
  std::string what;
  int peer;
  int64_t number;
  std::string detail;
};

// Bytes ready to go: one frame (or several), written from `off`.
struct OutBuf {
  Block data;
  size_t len = 0, off = 0;
};

class Engine;

struct Link {
  Link(uint64_t id, int peer, int fd, int64_t serial, const uint8_t* send_key, const uint8_t* recv_key,
       uint64_t max_message);
  ~Link();  // closes the fd: only when no thread holds the link any more (no fd reuse under a writer)
  const uint64_t id;  // unique per engine: the epoll key
  const int peer, fd;
  const int64_t serial;
  std::unique_ptr<Sealer> sealer;  // under the peer's send_mu
  std::atomic<bool> dead{false};

  // under out_mu
  std::mutex out_mu;
  std::condition_variable out_cv;  // a sender waiting for the queue to shrink
  std::deque<OutBuf> queue;
  std::atomic<uint64_t> queued{0};  // bytes in `queue` (read without the lock for epoll interest)
  std::atomic<double> last_sent{0};

  // the I/O thread's own
  FrameParser parser;
  std::unique_ptr<uint8_t[]> staging;
  size_t staged_from = 0, staged_to = 0;
  double last_heard = 0;
  uint32_t interest = 0;  // epoll events registered
  bool registered = false;
  bool hangup = false;  // epoll said EPOLLHUP/EPOLLERR: the peer is gone, what it sent may still be read
  std::atomic<bool> held{false};  // backpressure: not reading until recv makes room
  std::vector<uint8_t> abort_body;  // an ABORT frame's body while it lands
  MessagePtr landing;               // a DATA frame's payload while it lands
  bool landing_void = false;        // a DATA frame of a voided step: read, then counted as dropped
};
using LinkPtr = std::shared_ptr<Link>;

struct Peer {
  std::mutex send_mu;
  // under mu_
  LinkPtr link;
  int64_t connects = 0;
  bool was_connected = false;
  std::string error = "not connected yet";  // why the link is down (names the peer once it has been up)
};

// Counters read by stats(); atomics, as senders and the I/O thread bump them without mu_.
struct Stats {
  std::atomic<uint64_t> frames_in{0}, bytes_in{0}, frames_out{0}, bytes_out{0}, discarded{0}, heartbeats_out{0},
      stalls{0}, links_dropped{0};
};

class Engine {
 public:
  Engine(int rank, int world_size, uint64_t max_buffered_bytes, uint64_t max_message_bytes, double peer_timeout_s,
         double heartbeat_s, uint64_t max_discarded_bytes);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int64_t attach(int peer, int fd, const std::string* send_key, const std::string* recv_key);
  void detach(int peer, const std::string& reason);
  void send(int peer, const std::string& tag, const uint8_t* data, uint64_t size);
  MessagePtr recv(int peer, const std::string& tag, double timeout_s);
  bool holds(int peer, const std::string& prefix);  // a message under prefix from peer waits (nothing taken)
  MessagePtr recv_until(int peer, const std::string& tag, double timeout_s, double deadline);
  bool abort(const std::string& prefix, const std::string& code, const std::string& reason);
  std::optional<AbortInfo> voided(const std::string& tag);
  uint64_t buffered(int peer);
  std::vector<Event> next_events(double timeout_s);
  std::optional<double> stalled_since(double since);
  void set_admission(bool enabled, int64_t step_window, uint64_t max_agreement_bytes);
  void set_last_step(const std::string& job, int64_t tensor, int64_t last_step);
  void forget_tensor(const std::string& job, int64_t tensor);
  std::map<std::string, int64_t> stats();
  void close();

  int rank() const { return rank_; }

 private:
  friend class LinkSink;
  void check_peer(int peer) const;
  // Drops a link (any thread): peers waiting on it fail, the I/O thread forgets it. Idempotent.
  void drop(const LinkPtr& link, const std::string& reason);
  void push_event(Event ev);  // (under mu_)
  void wake();
  // Queues a frame on a link (under the peer's send_mu): written at once when nothing waits before it.
  bool enqueue(const LinkPtr& link, OutBuf buf, std::string* error);
  bool flush(Link& link, std::string* error);  // (under out_mu) writes what it can
  bool send_frame(const LinkPtr& link, uint8_t kind, const std::string& tag, const uint8_t* data, uint64_t size,
                  std::string* error);  // (under the peer's send_mu)

  void io_loop();
  void io_read(const LinkPtr& link);
  void io_retry_held();
  void io_timers(double round_start);
  bool io_stall_check(double from, double to);  // records a stall if we stood still from..to
  void io_interest(const LinkPtr& link);
  void io_unregister(const LinkPtr& link);

  const int rank_, world_size_;
  const uint64_t max_buffered_, max_message_, max_discarded_;
  const double peer_timeout_s_, heartbeat_s_;

  std::vector<std::unique_ptr<Peer>> peers_;
  std::mutex mu_;
  std::condition_variable cv_;         // messages arriving, links going, room made, close
  std::condition_variable events_cv_;  // events arriving
  Mailboxes boxes_;
  std::deque<Event> events_;
  std::deque<std::pair<double, double>> stalls_;  // (from, to) of our own pauses, the last 64
  bool closed_ = false;
  bool admission_ = false;
  int64_t step_window_ = 1 << 20;
  uint64_t max_agreement_ = 64 << 10;
  std::map<std::pair<std::string, int64_t>, int64_t> last_steps_;
  std::vector<LinkPtr> to_add_, to_remove_;  // for the I/O thread
  Stats stats_;

  std::atomic<double> last_tick_{0};  // the I/O loop's last round (stall detection)
  std::atomic<bool> stopping_{false};
  int epfd_ = -1, evfd_ = -1;
  uint64_t next_link_id_ = 1;  // (under mu_)
  std::map<uint64_t, LinkPtr> io_links_;  // the I/O thread's: by a key unique per link
  std::thread io_;
};

double monotonic_now();

}  // namespace zen
