// zend._engine: the Engine for Python. Every call that may wait releases the GIL.
#include <pybind11/eval.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "engine.h"

namespace py = pybind11;
using zen::Engine;
using zen::EngineFailure;
using zen::Message;
using zen::MessagePtr;

namespace {

py::object g_base, g_link_down, g_aborted, g_timeout, g_closed;

[[noreturn]] void raise(const EngineFailure& f) {
  py::object cls;
  switch (f.kind) {
    case EngineFailure::LinkDown: cls = g_link_down; break;
    case EngineFailure::Timeout: cls = g_timeout; break;
    case EngineFailure::Closed: cls = g_closed; break;
    case EngineFailure::Aborted: {
      py::object exc = g_aborted(f.code, f.reason);
      PyErr_SetObject(g_aborted.ptr(), exc.ptr());
      throw py::error_already_set();
    }
    default: throw py::value_error(f.message);
  }
  PyErr_SetString(cls.ptr(), f.message.c_str());
  throw py::error_already_set();
}

// A caller's bytes (any C-contiguous buffer), held while the GIL is released.
struct Bytes {
  Py_buffer view{};
  explicit Bytes(const py::handle& obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  }
  ~Bytes() { PyBuffer_Release(&view); }
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(view.buf); }
  uint64_t size() const { return static_cast<uint64_t>(view.len); }
};

// Runs `fn` without the GIL, raising its EngineFailure as the matching Python exception.
template <typename Fn>
auto released(Fn&& fn) -> decltype(fn()) {
  std::optional<EngineFailure> failure;
  {
    py::gil_scoped_release nogil;
    try {
      return fn();
    } catch (const EngineFailure& f) {
      failure = f;
    }
  }
  raise(*failure);
}

py::object make_exception(py::module_& m, const char* name, py::handle base, const char* doc) {
  py::object cls = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc((std::string("zend._engine.") + name).c_str(), doc, base.ptr(), nullptr));
  if (!cls) throw py::error_already_set();
  m.attr(name) = cls;
  return cls;
}

const uint8_t kEmpty = 0;

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "zen's native data plane: sealed frames over TCP, mailboxes, liveness (zend/transport/native)";
  g_base = make_exception(m, "EngineError", PyExc_Exception, "Base of the engine's errors.");
  g_link_down = make_exception(m, "LinkDown", g_base, "The peer's link is down, or was replaced while awaited.");
  g_timeout = make_exception(m, "Timeout", g_base, "No message came within the timeout.");
  g_closed = make_exception(m, "Closed", g_base, "The engine is closed.");
  // Aborted(code, reason): a Python class so that it carries both as attributes
  py::dict ns;
  ns["EngineError"] = g_base;
  py::exec(R"(
class Aborted(EngineError):
    """The tag's step was voided (abort): code and reason say why."""

    def __init__(self, code, reason):
        super().__init__(reason)
        self.code, self.reason = code, reason
)", ns, ns);
  g_aborted = ns["Aborted"];
  g_aborted.attr("__module__") = "zend._engine";
  m.attr("Aborted") = g_aborted;
  m.attr("CHUNK") = zen::CHUNK;
  m.attr("MAX_QUEUED_BYTES") = zen::MAX_QUEUED_BYTES;

  py::class_<Message, MessagePtr>(m, "Message", py::buffer_protocol())
      .def_buffer([](Message& msg) {
        uint8_t* p = msg.size() ? msg.data() : const_cast<uint8_t*>(&kEmpty);
        return py::buffer_info(p, 1, "B", 1, {static_cast<py::ssize_t>(msg.size())}, {1}, msg.size() == 0);
      })
      .def("__len__", [](const Message& msg) { return msg.size(); })
      .def("__bytes__", [](Message& msg) {
        return py::bytes(reinterpret_cast<const char*>(msg.data()), msg.size());
      });

  py::class_<Engine>(m, "Engine")
      .def(py::init([](int rank, int world_size, uint64_t max_buffered_bytes, uint64_t max_message_bytes,
                       double peer_timeout_s, double heartbeat_s, uint64_t max_discarded_bytes) {
             try {
               return new Engine(rank, world_size, max_buffered_bytes, max_message_bytes, peer_timeout_s,
                                 heartbeat_s, max_discarded_bytes);
             } catch (const EngineFailure& f) {
               raise(f);
             }
           }),
           py::arg("rank"), py::arg("world_size"), py::kw_only(), py::arg("max_buffered_bytes"),
           py::arg("max_message_bytes"), py::arg("peer_timeout_s"), py::arg("heartbeat_s"),
           py::arg("max_discarded_bytes") = uint64_t(64) << 20)
      .def(
          "attach",
          [](Engine& e, int peer, int fd, std::optional<py::bytes> send_key, std::optional<py::bytes> recv_key) {
            std::optional<std::string> sk, rk;
            if (send_key) sk = std::string(*send_key);
            if (recv_key) rk = std::string(*recv_key);
            return released([&] { return e.attach(peer, fd, sk ? &*sk : nullptr, rk ? &*rk : nullptr); });
          },
          py::arg("peer"), py::arg("fd"), py::arg("send_key"), py::arg("recv_key"))
      .def(
          "detach", [](Engine& e, int peer, const std::string& reason) { released([&] { e.detach(peer, reason); }); },
          py::arg("peer"), py::arg("reason"))
      .def(
          "send",
          [](Engine& e, int peer, const std::string& tag, const py::handle& data) {
            Bytes bytes(data);
            released([&] { e.send(peer, tag, bytes.data(), bytes.size()); });
          },
          py::arg("peer"), py::arg("tag"), py::arg("data"))
      .def(
          "recv",
          [](Engine& e, int peer, const std::string& tag, double timeout_s) {
            return released([&] { return e.recv(peer, tag, timeout_s); });
          },
          py::arg("peer"), py::arg("tag"), py::arg("timeout_s"))
      .def(
          "exchange",
          [](Engine& e, const py::list& sends, const py::list& recvs, double timeout_s) {
            std::vector<std::tuple<int, std::string, std::unique_ptr<Bytes>>> out;
            for (const auto& item : sends) {
              auto t = item.cast<py::tuple>();
              if (t.size() != 3) throw py::value_error("a send is (peer, tag, data)");
              out.emplace_back(t[0].cast<int>(), t[1].cast<std::string>(), std::make_unique<Bytes>(t[2]));
            }
            std::vector<std::pair<int, std::string>> in;
            for (const auto& item : recvs) in.push_back(item.cast<std::pair<int, std::string>>());
            return released([&] {
              std::optional<EngineFailure> send_failure;
              for (auto& [peer, tag, bytes] : out) {  // every send, in order, whatever happens to one
                try {
                  e.send(peer, tag, bytes->data(), bytes->size());
                } catch (const EngineFailure& f) {
                  if (!send_failure) send_failure = f;
                }
              }
              double deadline = zen::monotonic_now() + timeout_s;
              std::vector<MessagePtr> got;
              for (auto& [peer, tag] : in) got.push_back(e.recv_until(peer, tag, timeout_s, deadline));
              if (send_failure) throw *send_failure;
              return got;
            });
          },
          py::arg("sends"), py::arg("recvs"), py::arg("timeout_s"))
      .def(
          "abort",
          [](Engine& e, const std::string& prefix, const std::string& code, const std::string& reason) {
            return released([&] { return e.abort(prefix, code, reason); });
          },
          py::arg("prefix"), py::arg("code"), py::arg("reason"))
      .def(
          "voided",
          [](Engine& e, const std::string& tag) -> std::optional<std::pair<std::string, std::string>> {
            auto hit = e.voided(tag);
            if (!hit) return std::nullopt;
            return std::make_pair(hit->code, hit->reason);
          },
          py::arg("tag"))
      .def(
          "buffered", [](Engine& e, int peer) { return e.buffered(peer); }, py::arg("peer") = -1)
      .def(
          "next_events",
          [](Engine& e, double timeout_s) {
            auto events = released([&] { return e.next_events(timeout_s); });
            py::list out;
            for (auto& ev : events) out.append(py::make_tuple(ev.what, ev.peer, ev.number, ev.detail));
            return out;
          },
          py::arg("timeout_s"))
      .def("stalled_since", &Engine::stalled_since, py::arg("since_monotonic"))
      .def("holds", &Engine::holds, py::arg("peer"), py::arg("prefix"))
      .def("set_admission", &Engine::set_admission, py::arg("enabled"), py::arg("step_window"),
           py::arg("max_agreement_bytes"))
      .def("set_last_step", &Engine::set_last_step, py::arg("job_key"), py::arg("tensor"), py::arg("last_step"))
      .def("forget_tensor", &Engine::forget_tensor, py::arg("job_key"), py::arg("tensor"))
      .def("stats", &Engine::stats)
      .def("close", [](Engine& e) { released([&] { e.close(); }); })
      .def_property_readonly("rank", &Engine::rank);
}
