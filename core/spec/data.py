"""Training text for the DSpark drafter: files named on the command line, or `stdlib` (the Python standard
library's .py files minus the target's held-out list, the embedded model's own training split), tokenised
with the target's tokenizer as bos + text + eos documents packed back to back."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.errors import ConfigError

TEXT_SUFFIXES = frozenset({".py", ".txt", ".md", ".rst"})


@dataclass(frozen=True)
class DataSplit:
    train: tuple[Path, ...]
    calibration: tuple[Path, ...]  # not trained on: STS is fitted on these


def _heldout(target_dir: Path) -> set[str]:
    from deepinfer.train.corpus import HELDOUT_FILE_LIST, read_heldout_list

    return set(read_heldout_list(target_dir)) if (target_dir / HELDOUT_FILE_LIST).exists() else set()


def resolve_files(data: list[str], target_dir: Path) -> list[Path]:
    files: list[Path] = []
    for item in data:
        if item == "stdlib":
            from deepinfer.train.corpus import list_python_files, stdlib_root

            root, skip = stdlib_root(), _heldout(target_dir)
            files += [root / rel for rel in list_python_files(root) if rel not in skip]
            continue
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"--data {item!r}: no such file or folder (or use 'stdlib')")
    if not files:
        raise ConfigError(f"--data {data}: no text files found")
    return files


def split_files(files: list[Path], calibration_fraction: float, seed: int) -> DataSplit:
    order = sorted(set(files))
    random.Random(seed).shuffle(order)
    n = max(1, round(len(order) * calibration_fraction)) if len(order) > 1 else 0
    return DataSplit(tuple(sorted(order[n:])), tuple(sorted(order[:n])))


def encode_files(tokenizer_path: Path, files: tuple[Path, ...] | list[Path]) -> torch.Tensor:
    from tokenizers import Tokenizer

    from deepinfer.text.markers import EOS

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id(EOS)
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # not text: skipped, as the target's own corpus does
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=True):
        ids += enc.ids + ([eos] if eos is not None else [])
    return torch.tensor(ids, dtype=torch.int64)
