"""The training corpus: the `.py` files of the running interpreter's standard library, split by file.

Everything is deterministic for a given standard library: files are listed in sorted order of their path
relative to the stdlib root, and a `random.Random(seed)` shuffle of that list picks the held-out files.
Installed third-party packages (site-packages / dist-packages) and bytecode caches are excluded; files that
are not UTF-8 (a few test fixtures) or are very large (generated tables) are skipped.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
MAX_FILE_BYTES = 1_000_000
HELDOUT_FILE_LIST = "heldout_files.txt"


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[str, ...]  # paths relative to root, POSIX style
    heldout: tuple[str, ...]

    def read(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8")

    def texts(self, files: tuple[str, ...]) -> list[str]:
        return [self.read(rel) for rel in files]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_python_files(root: Path) -> list[str]:
    """Sorted relative paths of the readable UTF-8 .py files under root, third-party packages excluded."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append(rel.as_posix())
    return sorted(out)


def build_corpus(seed: int, heldout_fraction: float = 0.03, max_files: int | None = None, root: Path | None = None) -> Corpus:
    """Split the stdlib's files into train and held-out sets; max_files keeps a deterministic subset (smoke runs)."""
    root = root or stdlib_root()
    files = list_python_files(root)
    if not files:
        raise RuntimeError(f"no .py files found under {root}")
    rng = random.Random(seed)
    order = files[:]
    rng.shuffle(order)
    if max_files is not None:
        order = order[:max_files]
    n_heldout = max(1, round(len(order) * heldout_fraction))
    heldout = tuple(sorted(order[:n_heldout]))
    train = tuple(sorted(order[n_heldout:]))
    return Corpus(root, train, heldout)


def write_heldout_list(corpus: Corpus, folder: Path) -> Path:
    """One relative path per line; the header says which stdlib they are relative to."""
    path = folder / HELDOUT_FILE_LIST
    header = f"# held-out files, relative to the Python standard library ({corpus.root.name}); not trained on\n"
    path.write_text(header + "".join(f"{rel}\n" for rel in corpus.heldout), encoding="utf-8")
    return path


def read_heldout_list(folder: Path) -> list[str]:
    lines = (folder / HELDOUT_FILE_LIST).read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line and not line.startswith("#")]
