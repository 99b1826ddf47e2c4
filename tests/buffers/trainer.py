"""A trainer in its own process, holding buffers from the daemon, for the buffer tests.

Run as ``python -m tests.buffers.trainer PATH SESSION [TOKEN]``: it connects a BufferClient (with
TOKEN, by default :func:`token_of` the session), then
answers one JSON command per stdin line with one JSON line on stdout:
``{"cmd": "alloc", "nbytes": N, "device": "cpu"}`` -> ``{"buffer": id}``;
``{"cmd": "write", "buffer": id, "offset": o, "values": [...]}`` (float32) -> ``{}``;
``{"cmd": "read", "buffer": id, "offset": o, "count": c}`` -> ``{"values": [...]}``;
``{"cmd": "free", "buffer": id}`` -> ``{}``; ``{"cmd": "exit"}``. Errors come back as
``{"error": message}``. :class:`Trainer` is the parent's side of that conversation.
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.subprocess_env import with_project
from zend.buffers import BufferClient, SharedBuffer

ROOT = Path(__file__).resolve().parents[2]


def token_of(session: str) -> str:
    """The token the tests' buffer daemons expect with a session's claim."""
    return f"token-of-{session}"


def main() -> None:
    torch.set_num_threads(1)
    path, session = sys.argv[1], sys.argv[2]
    token = sys.argv[3] if len(sys.argv) > 3 else token_of(session)
    buffers: dict[str, SharedBuffer] = {}
    with BufferClient(path, session, token) as client:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                return
            try:
                reply = _run(client, buffers, cmd)
            except Exception as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(reply), flush=True)


def _run(client: BufferClient, buffers: dict[str, SharedBuffer], cmd: dict[str, Any]) -> dict[str, Any]:
    if cmd["cmd"] == "alloc":
        buf = client.alloc(cmd["nbytes"], cmd.get("device", "cpu"))
        buffers[buf.buffer_id] = buf
        return {"buffer": buf.buffer_id, "device": buf.device}
    if cmd["cmd"] == "free":
        client.free(cmd["buffer"])
        del buffers[cmd["buffer"]]
        return {}
    buf = buffers[cmd["buffer"]]
    if cmd["cmd"] == "write":
        view = buf.view(torch.float32, cmd["offset"], len(cmd["values"]))
        view.copy_(torch.tensor(cmd["values"], dtype=torch.float32))
        if view.is_cuda:
            torch.cuda.synchronize(view.device)
        return {}
    if cmd["cmd"] == "read":
        return {"values": buf.view(torch.float32, cmd["offset"], cmd["count"]).cpu().tolist()}
    raise ValueError(f"unknown command {cmd['cmd']!r}")


class Trainer:
    """A trainer subprocess; the test owns it and must call :meth:`kill` (in a finally)."""

    def __init__(self, path: str, session: str, timeout_s: float = 30.0) -> None:
        env = with_project(OMP_NUM_THREADS="1")
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.buffers.trainer", path, session], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()  # {"ready": true} once the session is open

    def call(self, **cmd: Any) -> dict[str, Any]:
        """Send one command, return its reply; AssertionError carrying the trainer's error."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        assert "error" not in reply, reply["error"]
        return reply

    def exit(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
        self.proc.stdin.flush()
        return self.proc.wait(self.timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(self.timeout_s)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.timeout_s):
                raise TimeoutError(f"trainer pid {self.proc.pid} gave no answer in {self.timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"trainer pid {self.proc.pid} exited with {self.proc.wait(self.timeout_s)}")
        reply: dict[str, Any] = json.loads(line)
        return reply


if __name__ == "__main__":
    main()
