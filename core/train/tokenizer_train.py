"""Byte-level BPE trained with HF `tokenizers`, carrying DeepSeek-V3's special tokens and chat template.

The special tokens take ids 0..14 in DeepSeek-V3's order, so bos = 0 and eos = 1 as in DeepSeek's own
vocabulary. tokenizer_config.json follows DeepSeek-V3's: bos added on encode, the chat template inline.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from deepinfer.text import DEEPSEEK_V3_CHAT_TEMPLATE, DEEPSEEK_V3_SPECIAL_TOKENS
from deepinfer.text.markers import BOS, EOS

# DeepSeek-V3's 15 special tokens, in its order; the brief's list and deepinfer.text agree on it.
SPECIAL_TOKENS: tuple[str, ...] = DEEPSEEK_V3_SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train on `texts` (held-out files excluded by the caller). Deterministic for the same texts in the same order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, whatever the corpus
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """DeepSeek-V3's tokenizer_config.json keys, with the project's DeepSeek-V3 chat template."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": DEEPSEEK_V3_CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, folder: Path, model_max_length: int) -> None:
    tok.save(str(folder / "tokenizer.json"))
    config = tokenizer_config(model_max_length)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each file as bos + its tokens + eos: documents are packed back to back for training."""
    eos = tok.token_to_id(EOS)
    return [enc.ids + [eos] for enc in tok.encode_batch(texts, add_special_tokens=True)]
