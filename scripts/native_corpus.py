"""Writes the fuzz corpus of zend._engine's parsers (zend/transport/native/corpus/): a few valid frames,
clear and sealed, and abort notices, built with the Python transport's own framing (framing.py,
sealing.py), so the fuzzer starts from what a real peer sends.

Each file is one input of zend/transport/native/fuzz_frames.cpp: a first byte (mode 0 clear frames,
1 sealed frames, 2 an abort notice; plus 3 x the feed size) and then the bytes. Sealed frames use the
fuzz target's fixed key (bytes 0..31), numbered from 0 as on a fresh link.
Usage: python scripts/native_corpus.py [OUTDIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zend.transport.frames import ABORT, DATA, GOODBYE, HEARTBEAT  # noqa: E402
from zend.transport.framing import Frames, frames_for  # noqa: E402
from zend.transport.sealing import LinkCipher  # noqa: E402

FUZZ_KEY = bytes(range(32))


def _notice(code: str, reason: str) -> bytes:
    return json.dumps({"code": code, "reason": reason}).encode()


def _stream(frames: Frames) -> bytes:
    """A link's first frames: data of a few sizes, a heartbeat, an abort, a goodbye."""
    out = bytearray()
    for kind, tag, payload in [
        (DATA, "job/1/2/0/reduce/0", b"x" * 64),
        (HEARTBEAT, "", b""),
        (DATA, "t", b""),
        (DATA, "job/1/2/0/agree/0", bytes(range(256)) * 20),
        (ABORT, "job/1/2/0/", _notice("ABORTED", "a step failed")),
        (GOODBYE, "", b""),
    ]:
        out += frames.head(kind, tag, len(payload))
        out += b"".join(bytes(piece) for piece in frames.pieces(memoryview(payload)))
    return bytes(out)


def main(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    clear = _stream(Frames())
    sealed = _stream(frames_for(LinkCipher(FUZZ_KEY, FUZZ_KEY)))
    small_sealed = frames_for(LinkCipher(FUZZ_KEY, FUZZ_KEY)).head(DATA, "a/b", 0)
    inputs = {
        "clear_whole": bytes([0]) + clear,
        "clear_feeds_of_7": bytes([0 + 3 * 7]) + clear,
        "sealed_whole": bytes([1]) + sealed,
        "sealed_feeds_of_13": bytes([1 + 3 * 13]) + sealed,
        "sealed_one_frame": bytes([1]) + small_sealed,
        "notice_plain": bytes([2]) + _notice("PEER_FAILED", "rank 1 lost"),
        "notice_escapes": bytes([2]) + _notice("ABORTED", 'q " b \\ / \b \f \n \r \t \x01 é 中 😀'),
    }
    for name, data in inputs.items():
        (outdir / name).write_bytes(data)
    print(f"wrote {len(inputs)} inputs to {outdir}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "zend/transport/native/corpus")
