"""CPU cost of sealed frames on one core: sealing and opening a payload, per GB and per frame.

What the data plane's `--data-plane-security aead` adds to every frame (zend/transport/sealing.py):
the sender seals the tag and each 1 MiB record of the payload with AES-256-GCM, the receiver
opens them. One thread, no I/O, buffers reused as the transports reuse them.

    python benchmarks/sealing_cost.py [--sizes 64,65536,1048576,16777216] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from zend.transport.frames import FRAME, pack_frame
from zend.transport.sealing import LinkCipher, sealed_size


def measure(size: int, total: int = 512 << 20) -> dict[str, float]:
    """Seconds per frame to seal and to open a `size`-byte payload (tag included), median of 5 runs."""
    secret = b"benchmark-secret-0123456789"
    sender, receiver = (LinkCipher.for_side(secret, b"transcript", dialer=d) for d in (True, False))
    data = memoryview(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy())  # type: ignore[arg-type]
    wire = bytearray(sealed_size(size))
    out = memoryview(bytearray(size))
    frames = max(20, total // max(size, 1))
    header = pack_frame("job/embedding/123/0/push/3", size)
    seal_s, open_s = [], []
    for _ in range(5):
        sealing = opening = 0.0
        for _ in range(frames):  # each frame sealed, then opened, in order (numbered records)
            t0 = time.perf_counter()
            head = sender.seal_head(header[: FRAME.size], header[FRAME.size :])
            sender.seal_all(data, memoryview(wire))
            t1 = time.perf_counter()
            receiver.open_head(head[: FRAME.size], head[FRAME.size :])
            receiver.open_all(memoryview(wire), out)
            opening += time.perf_counter() - t1
            sealing += t1 - t0
        seal_s.append(sealing / frames)
        open_s.append(opening / frames)
    return {"seal_s": sorted(seal_s)[2], "open_s": sorted(open_s)[2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,65536,1048576,16777216", help="payload bytes, comma-separated")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size in (int(x) for x in args.sizes.split(",")):
        r = measure(size)
        per_gb = (r["seal_s"] + r["open_s"]) * 1e9 / size
        rows.append({"bytes": size, "seal_us": r["seal_s"] * 1e6, "open_us": r["open_s"] * 1e6,
                     "seal_gb_per_s": size / r["seal_s"] / 1e9, "open_gb_per_s": size / r["open_s"] / 1e9,
                     "ms_per_gb_both_ends": per_gb * 1e3})
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    print("sealed frames, AES-256-GCM, one core (seal at the sender + open at the receiver)")
    print(f"{'payload B':>10} {'seal us':>9} {'open us':>9} {'seal GB/s':>10} {'open GB/s':>10} {'ms per GB':>10}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['seal_us']:9.1f} {r['open_us']:9.1f} {r['seal_gb_per_s']:10.2f} "
              f"{r['open_gb_per_s']:10.2f} {r['ms_per_gb_both_ends']:10.1f}")


if __name__ == "__main__":
    main()
