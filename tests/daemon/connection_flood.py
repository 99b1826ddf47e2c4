"""A process that opens many connections to a daemon's buffers.sock and says nothing on them.

`python -m tests.daemon.connection_flood PATH N`: opens N connections, prints {"opened": N}, then
for every line "look" on stdin prints what the connections hold now: how many are still open and
silent, how many got a message (and the distinct messages), how many were closed without one.
"""

from __future__ import annotations

import json
import resource
import socket
import struct
import sys


def look(socks: list[socket.socket]) -> dict[str, object]:
    silent, closed, errors = 0, 0, {}
    for s in socks:
        try:
            data = s.recv(1 << 16)
        except BlockingIOError:
            silent += 1
            continue
        except OSError:
            closed += 1
            continue
        if len(data) < 4:
            closed += 1
            continue
        (length,) = struct.unpack("<I", data[:4])
        error = str(json.loads(data[4:4 + length]).get("error"))
        errors[error] = errors.get(error, 0) + 1
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
    print(json.dumps({"opened": len(socks)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "look":
            break
        print(json.dumps(look(socks)), flush=True)


if __name__ == "__main__":
    main()
