"""The default model's training text: openly licensed English prose from Debian packages, made into documents.

    python tools/default_model_corpus.py --data-dir .cache/corpus   # fetch, extract, print the sizes

Every source is a Debian package that `apt-get download` fetches from the distribution's archive (no root needed);
the package files are unpacked with `dpkg-deb -x` into `--data-dir`, and the exact package versions and their
SHA-256 digests go into the model card, so anyone can check what the model was trained on.

| source | package | licence |
|---|---|---|
| Jane Austen's six novels (1811-1818) | `r-cran-janeaustenr` | public domain texts; the package is MIT |
| Ambrose Bierce, *The Devil's Dictionary* (1911) | `dict-devil` | public domain ("Copyright Expired") |
| The Jargon File 4.4.7 (Eric S. Raymond, ed.) | `jargon-text` | public domain (says its notice) |
| Python tutorial, FAQ and HOWTOs (rst sources) | `python3.11-doc` | PSF License; examples Zero-Clause BSD |

Documents are paragraphs joined back from their hard-wrapped lines, grouped into chunks of consecutive
paragraphs; every `HELD_OUT_EVERY`-th chunk of each source is held out for evaluation, the rest is training text.
The split depends only on the text, so it is the same on every machine.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import re
import subprocess
import unicodedata
import zlib
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("r-cran-janeaustenr", "dict-devil", "jargon-text", "python3.11-doc")
PARAGRAPHS_PER_CHUNK = 24
HELD_OUT_EVERY = 40  # one chunk in 40: ~2.5 % of the text


@dataclass(frozen=True)
class Source:
    """One unpacked package: its name, version and the SHA-256 of the .deb it came from."""

    package: str
    version: str
    sha256: str
    root: Path


@dataclass
class Corpus:
    """Training and held-out documents (each a chunk of paragraphs joined by blank lines), by source name."""

    train: dict[str, list[str]]
    held_out: dict[str, list[str]]
    sources: list[Source]

    def train_text(self) -> list[str]:
        return [doc for docs in self.train.values() for doc in docs]

    def held_out_text(self) -> list[str]:
        return [doc for docs in self.held_out.values() for doc in docs]


# ------------------------------------------------------------------------------------------------ fetch
def fetch(data_dir: Path) -> list[Source]:
    """Download (once) and unpack each package into `data_dir/<package>`; returns what was used."""
    data_dir.mkdir(parents=True, exist_ok=True)
    sources = []
    for package in PACKAGES:
        debs = sorted(data_dir.glob(f"{package}_*.deb"))
        if not debs:
            subprocess.run(["apt-get", "download", package], cwd=data_dir, check=True)
            debs = sorted(data_dir.glob(f"{package}_*.deb"))
        deb = debs[-1]
        root = data_dir / package
        if not root.is_dir():
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        version = deb.name.split("_")[1].replace("%3a", ":")
        sha256 = hashlib.sha256(deb.read_bytes()).hexdigest()
        sources.append(Source(package, version, sha256, root))
    return sources


# ------------------------------------------------------------------------------------------------ extract
def clean(text: str) -> str:
    """NFC, `_emphasis_` marks removed, control characters dropped (typographic quotes and dashes stay)."""
    text = unicodedata.normalize("NFC", text)
    text = re.sub(r"(?<!\w)_([^_\n]+)_(?!\w)", r"\1", text)
    text = text.replace("\r", "").replace("\t", "    ")
    return "".join(ch for ch in text if ch == "\n" or unicodedata.category(ch)[0] != "C")


def paragraphs(lines: list[str]) -> list[str]:
    """Join hard-wrapped lines back into paragraphs (blank lines separate them); collapse inner spaces."""
    result, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            result.append(" ".join(current))
            current = []
    if current:
        result.append(" ".join(current))
    return [re.sub(r"\s+", " ", paragraph) for paragraph in result]


def _r_strings(blob: bytes) -> list[str]:
    """Decode an R serialized character vector (XDR format, as in a lazy-load database entry)."""
    assert blob[:2] == b"X\n", "not an XDR R serialization"
    pos = 2 + 3 * 4  # format version, writer's R version, minimal reader version
    version = int.from_bytes(blob[2:6], "big")
    if version == 3:
        (encoding_len,) = (int.from_bytes(blob[pos : pos + 4], "big"),)
        pos += 4 + encoding_len
    flags = int.from_bytes(blob[pos : pos + 4], "big")
    assert flags & 0xFF == 16, "not a character vector (STRSXP)"
    count = int.from_bytes(blob[pos + 4 : pos + 8], "big")
    pos += 8
    strings = []
    for _ in range(count):
        assert int.from_bytes(blob[pos : pos + 4], "big") & 0xFF == 9  # CHARSXP
        length = int.from_bytes(blob[pos + 4 : pos + 8], "big", signed=True)
        pos += 8
        if length < 0:
            strings.append("")
            continue
        strings.append(blob[pos : pos + length].decode("utf-8", errors="replace"))
        pos += length
    return strings


def austen(root: Path) -> list[str]:
    """The six novels, from janeaustenr's lazy-load database (one R character vector of lines per novel)."""
    database = (root / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb").read_bytes()
    # The database is a sequence of records (4-byte big-endian uncompressed length, then a zlib stream), one per
    # novel; walking them needs no index (Rdata.rdx, a general R list, names them).
    novels, pos = [], 0
    while pos < len(database):
        length = int.from_bytes(database[pos : pos + 4], "big")
        decompressor = zlib.decompressobj()
        blob = decompressor.decompress(database[pos + 4 :])
        assert len(blob) == length
        pos = len(database) - len(decompressor.unused_data)
        novels.append(paragraphs(_r_strings(blob)))
    assert len(novels) == 6, f"expected six novels, found {len(novels)}"
    return [paragraph for novel in novels for paragraph in novel]


def devils_dictionary(root: Path) -> list[str]:
    """The dictionary's text (dictzip is gzip-compatible), without the dictd headers and the e-text notice."""
    text = gzip.decompress((root / "usr/share/dictd/devil.dict.dz").read_bytes()).decode("latin-1")
    start = text.index("PREFACE")
    return paragraphs(text[start:].splitlines())


def jargon_file(root: Path) -> list[str]:
    """The Jargon File's entries and essays: paragraphs of prose (its box-drawn tables are dropped)."""
    text = gzip.decompress((root / "usr/share/doc/jargon-text/jargon.txt.gz").read_bytes())
    lines = text.decode("utf-8").splitlines()
    return [
        paragraph
        for paragraph in paragraphs(
            ["" if re.search("[\u2500-\u257f]", line) else line for line in lines]
        )
        if len(paragraph.split()) >= 6
    ]


_RST_ROLE = re.compile(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_RST_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_+")


def python_docs(root: Path) -> list[str]:
    """Prose paragraphs of the tutorial, FAQ and HOWTOs: directives, tables, headings underlines and code blocks
    dropped; inline markup reduced to its text (":func:`len`" -> "len", "``x``" -> "x")."""
    sources = root / "usr/share/doc/python3.11/html/_sources"
    files = [
        path
        for part in ("tutorial", "faq", "howto")
        for path in sorted((sources / part).glob("*.rst.txt"))
    ]
    result = []
    for path in files:
        for paragraph in _rst_paragraphs(path.read_text(encoding="utf-8")):
            paragraph = _RST_ROLE.sub(r"\1", paragraph)
            paragraph = _RST_LINK.sub(r"\1", paragraph)
            paragraph = paragraph.replace("``", "").replace("**", "").replace("`", "")
            paragraph = paragraph.replace("::", ":")
            if len(paragraph.split()) >= 6:
                result.append(paragraph)
    return result


def _rst_paragraphs(text: str) -> list[str]:
    """Unindented paragraphs of an rst file, minus directives, comments, headings and tables."""
    kept: list[str] = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if line[:1].isspace() or line.startswith(".."):
            kept.append(
                ""
            )  # indented blocks (code, directive bodies) end a paragraph and are dropped
        elif re.fullmatch(r"([=\-~^*+#\"'])\1{2,}", line.strip()) or re.fullmatch(
            r"([=\-~^*+#\"'])\1{2,}", following.strip()
        ):
            kept.append("")  # a heading and its underline
        elif line.startswith(("+", "|", "=")):
            kept.append("")
        else:
            kept.append(line)
    return paragraphs(kept)


# ------------------------------------------------------------------------------------------------ split
def split(paragraph_list: list[str]) -> tuple[list[str], list[str]]:
    """Chunks of `PARAGRAPHS_PER_CHUNK` paragraphs; every `HELD_OUT_EVERY`-th (counting from the 20th) held out."""
    chunks = [
        "\n\n".join(paragraph_list[start : start + PARAGRAPHS_PER_CHUNK])
        for start in range(0, len(paragraph_list), PARAGRAPHS_PER_CHUNK)
    ]
    held_out = [chunk for index, chunk in enumerate(chunks) if index % HELD_OUT_EVERY == 19]
    train = [chunk for index, chunk in enumerate(chunks) if index % HELD_OUT_EVERY != 19]
    return train, held_out


def load_corpus(data_dir: Path) -> Corpus:
    """Fetch, extract, clean and split every source."""
    sources = fetch(data_dir)
    roots = {source.package: source.root for source in sources}
    extracted = {
        "austen": austen(roots["r-cran-janeaustenr"]),
        "devils_dictionary": devils_dictionary(roots["dict-devil"]),
        "jargon_file": jargon_file(roots["jargon-text"]),
        "python_docs": python_docs(roots["python3.11-doc"]),
    }
    train, held_out = {}, {}
    for name, paragraph_list in extracted.items():
        train[name], held_out[name] = split([clean(p) for p in paragraph_list if clean(p).strip()])
    return Corpus(train, held_out, sources)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path(".cache/corpus"))
    parser.add_argument("--show", type=int, default=0, help="print the first N training documents")
    args = parser.parse_args()
    corpus = load_corpus(args.data_dir)
    for name in corpus.train:
        train_chars = sum(map(len, corpus.train[name]))
        held_chars = sum(map(len, corpus.held_out[name]))
        print(
            f"{name:<20} train {train_chars / 1e6:6.2f} M chars   held out {held_chars / 1e3:6.1f} k chars"
        )
    for doc in corpus.train_text()[: args.show]:
        print("-" * 80)
        print(doc[:1500])


if __name__ == "__main__":
    main()
