"""Rebuild zend/simulator/data/austen_gpt2.npy: Jane Austen's six novels as GPT-2 BPE token ids.

Everything comes from the package registries, nothing from a model hub:
- the text: Debian package r-cran-janeaustenr (public-domain novels, stored as R data),
  read with the pure-Python `rdata` package;
- the tokenizer: GPT-2's byte-pair encoding (50,257 ids) from `gpt2.tiktoken`, which the
  PyPI sdist of openai-whisper ships, run by `tiktoken`.

Usage: python scripts/build_trace_fixture.py [--out zend/simulator/data/austen_gpt2.npy]
Needs: apt-get, pip, and `pip install rdata tiktoken`.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import os
import subprocess
import tarfile
import tempfile
import zlib

import numpy as np

GPT2_VOCAB = 50257
# GPT-2's pre-tokenizer pattern (the one tiktoken's r50k_base uses).
GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
NOVELS = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion"]


def fetch_austen(workdir: str) -> list[str]:
    """Return the six novels, each as one string (paragraphs joined by newlines)."""
    import rdata

    subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=workdir, check=True)
    deb = glob.glob(os.path.join(workdir, "r-cran-janeaustenr_*.deb"))[0]
    root = os.path.join(workdir, "root")
    subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
    base = os.path.join(root, "usr/lib/R/site-library/janeaustenr/data/Rdata")
    # An R lazy-load database: the .rdx index (gzip, R serialisation) gives (offset, length)
    # of each object in the .rdb, stored as a 4-byte length followed by zlib data.
    with open(base + ".rdx", "rb") as f:
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(f.read())))
    with open(base + ".rdb", "rb") as f:
        blob = f.read()
    books = []
    for name in NOVELS:
        offset, length = (int(x) for x in index["variables"][name])
        raw = zlib.decompress(blob[offset + 4 : offset + length])
        lines = rdata.conversion.convert(rdata.parser.parse_data(raw), default_encoding="utf-8")
        books.append("\n".join(str(line) for line in lines))
    return books


def fetch_gpt2_encoding(workdir: str):  # -> tiktoken.Encoding
    import tiktoken
    import tiktoken.load

    subprocess.run(
        ["pip", "download", "--no-deps", "--no-binary", ":all:", "-d", workdir, "openai-whisper==20250625"],
        check=True,
    )
    sdist = glob.glob(os.path.join(workdir, "openai_whisper-*.tar.gz"))[0]
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
        tar.extract(member, workdir, filter="data")
        path = os.path.join(workdir, member.name)
    ranks = tiktoken.load.load_tiktoken_bpe(path)
    enc = tiktoken.Encoding(
        name="gpt2", pat_str=GPT2_SPLIT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
    )
    assert enc.n_vocab == GPT2_VOCAB, enc.n_vocab
    return enc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="zend/simulator/data/austen_gpt2.npy")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        books = fetch_austen(workdir)
        enc = fetch_gpt2_encoding(workdir)
        ids: list[int] = []
        for book in books:
            ids.extend(enc.encode_ordinary(book))
            ids.append(50256)  # <|endoftext|> between documents, as GPT-2 training does
    tokens = np.asarray(ids, dtype=np.uint16)  # 50,257 ids fit in 16 bits: half the file size
    np.save(args.out, tokens)
    print(f"wrote {args.out}: {tokens.size:,} tokens, {len(np.unique(tokens)):,} distinct ids, vocab {GPT2_VOCAB}")


if __name__ == "__main__":
    main()
