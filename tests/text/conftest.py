"""Fixtures for the text tests: a small byte-level BPE carrying DeepSeek's special tokens, trained here.

DeepSeek's own tokenizer cannot be downloaded in CI, so each session trains a few-hundred-token BPE on a mixed
corpus (ASCII, CJK, emoji, JSON, code) and writes it as a checkpoint folder would hold it.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from deepinfer.text import Tokenizer
from deepinfer.text.markers import BOS, DEEPSEEK_V3_SPECIAL_TOKENS, EOS

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers is only ever pointed at local folders here
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CORPUS = [
    "Hello world, this is a small test of the tokenizer.",
    "The weather in Paris is sunny; the temperature is 21 degrees.",
    "你好，世界！这是一个中文测试句子。天气很好。",
    "こんにちは世界、日本語のテストです。",
    "emoji: 😀🎉👍🏽 and accents: café, naïve, Ærøskøbing",
    '{"city": "Paris", "unit": "celsius", "days": [1, 2, 3], "ok": true}',
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "```json\n{\"location\": \"Tokyo\"}\n```",
    "Let me think step by step about the question before answering.",
]


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in DEEPSEEK_V3_SPECIAL_TOKENS])
    return tok.to_str()


def _added_token(content: str) -> dict[str, Any]:
    flags = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    return {"__type": "AddedToken", "content": content, **flags}


def write_tokenizer_folder(
    folder: Path,
    *,
    config: dict[str, Any] | None = None,
    post_processor: str | None = "byte_level",
    added_tokens: list[AddedToken] = (),
) -> Path:
    """Write tokenizer.json + tokenizer_config.json (DeepSeek-V3's settings, updated with `config`; a None value
    removes the key). post_processor: "byte_level", "bos_template" (adds bos itself) or None."""
    folder.mkdir(parents=True, exist_ok=True)
    backend = BackendTokenizer.from_str(_trained_tokenizer_json())
    if added_tokens:
        backend.add_tokens(list(added_tokens))
    if post_processor == "byte_level":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    elif post_processor == "bos_template":
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, backend.token_to_id(BOS))]
        )
    backend.save(str(folder / "tokenizer.json"))
    settings: dict[str, Any] = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": _added_token(BOS),
        "eos_token": _added_token(EOS),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 16384,
        "pad_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    for key, value in (config or {}).items():
        if value is None:
            settings.pop(key, None)
        else:
            settings[key] = value
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, ensure_ascii=False, indent=2), encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def make_tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: make_tokenizer_folder(config=..., post_processor=..., added_tokens=...) -> a fresh folder."""

    def make(**kwargs: Any) -> Path:
        return write_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"), **kwargs)

    return make


@pytest.fixture(scope="session")
def tokenizer_folder(make_tokenizer_folder: Callable[..., Path]) -> Path:
    """DeepSeek-V3-like folder with no chat template (the built-in one applies)."""
    return make_tokenizer_folder()


@pytest.fixture(scope="session")
def tokenizer(tokenizer_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(tokenizer_folder)


@pytest.fixture(scope="session")
def hf_tokenizer_for() -> Callable[[Path], Any]:
    """transformers' fast tokenizer loaded from a folder: the independent reference."""
    from transformers import PreTrainedTokenizerFast

    return functools.lru_cache(maxsize=None)(lambda folder: PreTrainedTokenizerFast.from_pretrained(str(folder)))
