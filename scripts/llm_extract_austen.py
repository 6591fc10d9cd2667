"""Extract Jane Austen's six novels from the Debian package ``r-cran-janeaustenr``.

The package (MIT-licensed R packaging of public-domain Project Gutenberg texts) stores the books
in an R lazy-load database (``data/Rdata.rdb`` + ``Rdata.rdx``). This script reads that database
with a small parser of R's XDR serialization format (enough for character vectors), so neither R
nor any extra Python package is needed.

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb /tmp/ja
    python scripts/llm_extract_austen.py --root /tmp/ja --out /tmp/austen

or, with the package installed (``apt-get install --no-install-recommends r-cran-janeaustenr``),
``--root /``. Writes one ``<book>.txt`` per novel (lines joined with newlines, as in the package).
"""

from __future__ import annotations

import argparse
import gzip
import struct
import zlib
from pathlib import Path

PKG_DATA = "usr/lib/R/site-library/janeaustenr/data"
BOOKS = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion"]


class _RReader:
    """Minimal reader for R's XDR serialization (format version 2/3)."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization stream")
        self.d = data
        self.p = 2
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal R version
        if version == 3:
            n = self.int()
            self.p += n  # native encoding
        self.refs: list[object] = []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.d, self.p)
        self.p += 4
        return v

    def item(self) -> object:
        flags = self.int()
        typ = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if typ == 254:  # NILVALUE_SXP
            return None
        if typ in (242, 251, 252, 253):  # EMPTYENV, MISSINGARG, BASEENV, GLOBALENV etc.
            return None
        if typ == 255:  # REFSXP
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if typ == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if typ == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.d[self.p : self.p + n].decode("utf-8", errors="replace")
            self.p += n
            return s
        if typ in (2, 6):  # LISTSXP (pairlist) / LANGSXP
            out = {}
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            out[tag] = car
            if isinstance(cdr, dict):
                out.update(cdr)
            del attr
            return out
        if typ in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self.int()
            vals = [self.item() for _ in range(n)]
            attrs = self.item() if has_attr else None
            if typ == 19 and isinstance(attrs, dict) and isinstance(attrs.get("names"), list):
                return dict(zip(attrs["names"], vals))
            return vals
        if typ in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            vals = list(struct.unpack_from(f">{n}i", self.d, self.p))
            self.p += 4 * n
            if has_attr:
                self.item()
            return vals
        if typ == 14:  # REALSXP
            n = self.int()
            vals = list(struct.unpack_from(f">{n}d", self.d, self.p))
            self.p += 8 * n
            if has_attr:
                self.item()
            return vals
        raise ValueError(f"unsupported SEXP type {typ} at byte {self.p}")


def _decompress(blob: bytes) -> bytes:
    (n,) = struct.unpack_from(">I", blob, 0)
    kind = blob[4:5]
    if kind == b"Z":
        return zlib.decompress(blob[5:])
    if kind == b"2":
        import bz2

        return bz2.decompress(blob[5:])
    if kind == b"X":
        import lzma

        return lzma.decompress(blob[5:])
    if kind == b"0":
        return blob[5 : 5 + n]
    return zlib.decompress(blob[4:])  # R_compress1: plain zlib after the length


def read_books(root: Path) -> dict[str, str]:
    data_dir = root / PKG_DATA
    index = _RReader(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).item()
    assert isinstance(index, dict)
    variables = index["variables"]
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    books = {}
    for name in BOOKS:
        off, length = (int(v) for v in variables[name])
        lines = _RReader(_decompress(rdb[off : off + length])).item()
        assert isinstance(lines, list)
        books[name] = "\n".join(line or "" for line in lines)
    return books


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("/"), help="where the .deb is unpacked (default /)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in read_books(args.root).items():
        (args.out / f"{name}.txt").write_text(text + "\n", encoding="utf-8")
        print(f"{name}: {len(text):,} chars, {len(text.split()):,} words")


if __name__ == "__main__":
    main()
