"""A process that opens many connections to a daemon's buffers.sock and says nothing on them.

`python -m tests.daemon.connection_flood PATH N`: opens N connections, prints {"opened": N}, then
answers a command per line on stdin:

- "look": what the connections hold now: how many are still open and silent, how many got a message
  (and the distinct messages), how many were closed without one. A connection's outcome is reported
  by the first look that sees it, and by no later one.
- "peek": the same counts over every connection since the start (what every look would have reported
  so far, and the silent ones now), reporting nothing as seen: a test polls it to wait for the
  daemon's answers, then looks.
"""

from __future__ import annotations

import json
import resource
import socket
import struct
import sys


class Flood:
    def __init__(self, socks: list[socket.socket]):
        self.socks = socks
        self.outcome: list[str | None] = [None] * len(socks)  # "closed", or the error message that came
        self.reported = [False] * len(socks)

    def _read(self) -> None:
        for i, s in enumerate(self.socks):
            if self.outcome[i] is not None:
                continue
            try:
                data = s.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                self.outcome[i] = "closed"
                continue
            if len(data) < 4:
                self.outcome[i] = "closed"
                continue
            (length,) = struct.unpack("<I", data[:4])
            self.outcome[i] = "error:" + str(json.loads(data[4:4 + length]).get("error"))

    def counts(self, only_new: bool) -> dict[str, object]:
        self._read()
        silent, closed, errors = 0, 0, {}
        for i, outcome in enumerate(self.outcome):
            if outcome is None:
                silent += 1
            elif only_new and self.reported[i]:
                continue
            elif outcome == "closed":
                closed += 1
            else:
                error = outcome.removeprefix("error:")
                errors[error] = errors.get(error, 0) + 1
            if only_new and outcome is not None:
                self.reported[i] = True
        return {"silent": silent, "closed": closed, "errors": errors}


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.setblocking(False)
        socks.append(s)
    flood = Flood(socks)
    print(json.dumps({"opened": len(socks)}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command not in ("look", "peek"):
            break
        print(json.dumps(flood.counts(only_new=command == "look")), flush=True)


if __name__ == "__main__":
    main()
