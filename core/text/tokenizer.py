"""Tokenizer: a checkpoint's tokenizer.json (HF `tokenizers`, Rust) plus what tokenizer_config.json adds.

tokenizer_config.json contributes the named special tokens (bos/eos/...), added tokens declared only there,
`add_bos_token`/`add_eos_token` and the chat templates. Ids and text match transformers' fast tokenizer for the
same folder, with one deliberate difference: like transformers 4.x (and unlike 5.x, which drops these keys
whenever tokenizer.json exists), a config that states add_bos_token or add_eos_token decides which of bos/eos
encoding adds; tokenizer.json's post-processor is rebuilt to match. A config silent on both keeps tokenizer.json's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from deepinfer.errors import CheckpointError, ConfigError, InvalidInputError
from deepinfer.text.chat_template import ChatTemplate, ChatTemplateError, choose_chat_template, load_chat_templates

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(key: str, value: Any) -> str | None:
    """A special token as configured: a string, an AddedToken-style object with "content", or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(f"{TOKENIZER_CONFIG_FILE}: {key} must be a string or an object with content, got {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


class Tokenizer:
    """Encode, decode and chat-template a model's text. Build with `Tokenizer.from_folder(checkpoint_dir)`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        *,
        chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        config = dict(config or {})
        self._backend = backend
        # Silent truncation or padding from tokenizer.json would corrupt prompts; length limits are the engine's job.
        backend.no_truncation()
        backend.no_padding()
        self.named_special_tokens: dict[str, str] = {}
        for key in NAMED_SPECIAL_TOKENS:
            content = _token_content(key, config.get(key))
            if content is not None:
                self.named_special_tokens[key] = content
        self._add_configured_tokens(config)
        self.add_bos_token = bool(config.get("add_bos_token", False)) and self.bos_token is not None
        self.add_eos_token = bool(config.get("add_eos_token", False)) and self.eos_token is not None
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            self._install_post_processor()
        max_len = config.get("model_max_length")
        self.model_max_length: int | None = max_len if isinstance(max_len, int) and max_len < 10**12 else None
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.special_tokens: frozenset[str] = frozenset(added[i].content for i in self.special_token_ids)
        self.chat_templates: dict[str, str] = dict(chat_templates or {})

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json (optional), special_tokens_map.json (optional) and chat
        templates. Raises CheckpointError for missing or unreadable files, ConfigError for a template that does
        not compile."""
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(f"{folder} has no {TOKENIZER_FILE}; only fast (tokenizers) checkpoints are supported")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust loader raises plain Exception for any malformed file
            raise CheckpointError(f"cannot load {path}: {e}") from None
        config_path = folder / TOKENIZER_CONFIG_FILE
        config = _read_json(config_path) if config_path.is_file() else {}
        map_path = folder / SPECIAL_TOKENS_MAP_FILE
        if map_path.is_file():  # older checkpoints name their special tokens only here
            for key, value in _read_json(map_path).items():
                if key in NAMED_SPECIAL_TOKENS and config.get(key) is None:
                    config[key] = value
        try:
            templates = load_chat_templates(folder, config)
            for name, source in templates.items():
                try:
                    ChatTemplate(source)
                except ChatTemplateError as e:
                    raise ConfigError(f"{folder}: chat template {name!r}: {e}") from None
        except ChatTemplateError as e:
            raise ConfigError(f"{folder}: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read a chat template in {folder}: {e}") from None
        return cls(backend, config, chat_templates=templates)

    def _add_configured_tokens(self, config: Mapping[str, Any]) -> None:
        """Add tokens the config declares but tokenizer.json lacks (transformers does the same on load)."""
        present = {t.content: t for t in self._backend.get_added_tokens_decoder().values()}
        declared = config.get("added_tokens_decoder") or {}
        if not isinstance(declared, Mapping):
            raise CheckpointError(f"{TOKENIZER_CONFIG_FILE}: added_tokens_decoder must be an object")
        new: list[AddedToken] = []
        for key in sorted(declared, key=lambda k: int(k) if str(k).isdigit() else 0):
            spec = declared[key]
            if not (isinstance(spec, Mapping) and isinstance(spec.get("content"), str)):
                raise CheckpointError(f"{TOKENIZER_CONFIG_FILE}: added_tokens_decoder[{key}] has no content")
            special = bool(spec.get("special", False))
            old = present.get(spec["content"])
            if old is None or old.special != special:
                new.append(
                    AddedToken(
                        spec["content"],
                        single_word=bool(spec.get("single_word", False)),
                        lstrip=bool(spec.get("lstrip", False)),
                        rstrip=bool(spec.get("rstrip", False)),
                        normalized=bool(spec.get("normalized", not special)),
                        special=special,
                    )
                )
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, Mapping):
            extra = list(extra.values())
        names = [*self.named_special_tokens.values(), *(_token_content("extra_special_tokens", t) for t in extra)]
        pending = {t.content for t in new}
        for content in names:
            if content is not None and content not in present and content not in pending:
                new.append(AddedToken(content, special=True, normalized=False))
                pending.add(content)
        if new:
            self._backend.add_tokens(new)

    def _install_post_processor(self) -> None:
        def side(sequence: str, type_id: int) -> list[str]:
            parts = [f"{self.bos_token}:{type_id}"] if self.add_bos_token else []
            parts.append(f"${sequence}:{type_id}")
            if self.add_eos_token:
                parts.append(f"{self.eos_token}:{type_id}")
            return parts

        specials = []
        if self.add_bos_token:
            specials.append((self.bos_token, self._backend.token_to_id(self.bos_token)))
        if self.add_eos_token:
            specials.append((self.eos_token, self._backend.token_to_id(self.eos_token)))
        self._backend.post_processor = processors.TemplateProcessing(
            single=" ".join(side("A", 0)), pair=" ".join(side("A", 0) + side("B", 1)), special_tokens=specials
        )

    # --- tokens -------------------------------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (for batch encoding and offsets)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included: every valid id is below it."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.named_special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.named_special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.named_special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.named_special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self._backend.token_to_id(self.pad_token)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_ids(self, tokens: Iterable[str]) -> frozenset[int]:
        """Ids of those of `tokens` this vocabulary has (e.g. the stream markers to keep when skipping specials)."""
        ids = (self._backend.token_to_id(t) for t in tokens)
        return frozenset(i for i in ids if i is not None)

    # --- text <-> ids -------------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`. Added and special tokens written in the text are matched as tokens. With
        `add_special_tokens`, the post-processor adds bos/eos as configured; chat-templated prompts already
        carry them, so encode those with add_special_tokens=False."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text to encode must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def check_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` as a list of ints, each a valid id; InvalidInputError naming the first bad one otherwise."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = list(ids)
        limit = self.vocab_size
        for i, token_id in enumerate(ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < limit:
                raise InvalidInputError(f"token ids[{i}] = {token_id!r} is not an id of this vocabulary (0..{limit-1})")
        return ids

    def decode(
        self,
        ids: Sequence[int],
        *,
        skip_special_tokens: bool = False,
        keep_special_tokens: Collection[str] = (),
    ) -> str:
        """Text of `ids`. Bytes that do not form complete UTF-8 characters come out as U+FFFD. With
        `skip_special_tokens`, special tokens are left out except those named in `keep_special_tokens`."""
        ids = self.check_ids(ids)
        keep_ids = self.token_ids(keep_special_tokens) if skip_special_tokens else frozenset()
        return self.decode_valid_ids(ids, skip_special_tokens, keep_ids)

    def decode_valid_ids(self, ids: list[int], skip_special_tokens: bool, keep_ids: frozenset[int]) -> str:
        """`decode` for ids that passed `check_ids`, with the kept ids given as ids (the detokenizer's hot path)."""
        if skip_special_tokens and keep_ids:
            # Same result as tokenizers' own skipping, minus the kept ids.
            drop = self.special_token_ids - keep_ids
            ids = [i for i in ids if i not in drop]
            skip_special_tokens = False
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # --- chat -----------------------------------------------------------------------------------------------

    @property
    def uses_builtin_chat_template(self) -> bool:
        """True when the checkpoint ships no chat template and the built-in DeepSeek-V3 one is used."""
        return not self.chat_templates

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` (OpenAI-style dicts) with the checkpoint's template, or `chat_template` (a template
        name or a template source). Returns the prompt text, or its ids with `tokenize`. Raises
        ChatTemplateError (an InvalidInputError) when the template rejects the conversation."""
        source = choose_chat_template(self.chat_templates, chat_template, tools)
        text = ChatTemplate(source).render(
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            special_tokens=self.named_special_tokens,
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
