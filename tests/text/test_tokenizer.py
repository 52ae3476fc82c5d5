"""Tokenizer: parity with transformers' fast tokenizer on the same folder, config handling, typed errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from deepinfer.errors import CheckpointError, InvalidInputError
from deepinfer.text import STREAM_MARKERS, Tokenizer
from deepinfer.text.markers import BOS, EOS, THINK_END, THINK_START, TOOL_CALLS_BEGIN, USER

TEXTS = [
    "",
    "Hello world",
    "  leading and trailing spaces  ",
    "你好，世界！ emoji 😀🎉👍🏽 café",
    f"{BOS}{USER}Hi there{EOS}",
    f"{THINK_START}\nreasoning\n{THINK_END}answer {TOOL_CALLS_BEGIN}",
    "text<｜User｜>glued<think>to</think>specials",
    "<｜tool▁call▁begin not a token <｜ half",
    "line1\nline2\n\n\ttab",
]

# Text built from pieces that stress byte-level BPE: specials, partial specials, multi-byte characters.
text_pieces = st.sampled_from(
    [BOS, EOS, USER, THINK_START, THINK_END, TOOL_CALLS_BEGIN, "<｜", "｜>", "<think", " ", "\n", "a", "Hello"]
    + ["中文", "😀", "é", "{", '"']
)
texts = st.one_of(st.text(max_size=40), st.lists(text_pieces, max_size=20).map("".join))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer, tokenizer_folder, hf_tokenizer_for, text):
    hf = hf_tokenizer_for(tokenizer_folder)
    for add_special in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=add_special)
        assert ids == hf.encode(text, add_special_tokens=add_special)
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tokenizer.decode(tokenizer.encode(text)) == text


@FAST
@given(text=texts)
def test_encode_decode_match_transformers_on_random_text(tokenizer, tokenizer_folder, hf_tokenizer_for, text):
    hf = hf_tokenizer_for(tokenizer_folder)
    ids = tokenizer.encode(text)
    assert ids == hf.encode(text)
    assert tokenizer.decode(ids) == hf.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@FAST
@given(data=st.data())
def test_decode_of_random_ids_matches_transformers(tokenizer, tokenizer_folder, hf_tokenizer_for, data):
    hf = hf_tokenizer_for(tokenizer_folder)
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=30))
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_tokens_from_config(tokenizer):
    assert tokenizer.bos_token == BOS and tokenizer.eos_token == EOS
    assert tokenizer.bos_token_id == tokenizer.token_to_id(BOS) is not None
    assert tokenizer.eos_token_id == tokenizer.token_to_id(EOS) is not None
    assert tokenizer.pad_token is None and tokenizer.pad_token_id is None
    assert tokenizer.model_max_length == 16384
    assert not tokenizer.add_bos_token and not tokenizer.add_eos_token
    assert {BOS, EOS, THINK_START} <= tokenizer.special_tokens
    assert tokenizer.id_to_token(tokenizer.eos_token_id) == EOS
    # DeepSeek-V3 ships add_bos_token false: the chat template writes bos itself.
    assert tokenizer.encode("Hi")[0] != tokenizer.bos_token_id


@pytest.mark.parametrize(
    ("config", "post_processor", "adds_bos", "adds_eos"),
    [
        ({"add_bos_token": True}, "byte_level", True, False),
        ({"add_bos_token": True, "add_eos_token": True}, "byte_level", True, True),
        ({"add_eos_token": True, "add_bos_token": None}, "byte_level", False, True),
        ({"add_bos_token": False}, "bos_template", False, False),  # the config wins over tokenizer.json
        # a config silent on both: tokenizer.json decides
        ({"add_bos_token": None, "add_eos_token": None}, "bos_template", True, False),
        ({"add_bos_token": None, "add_eos_token": None}, None, False, False),
    ],
)
def test_add_bos_eos_rules(make_tokenizer_folder, hf_tokenizer_for, config, post_processor, adds_bos, adds_eos):
    """The config's add_bos_token/add_eos_token decide, as in transformers 4.x fast tokenizers (transformers 5
    ignores them when tokenizer.json exists), so the reference is transformers' plain encoding plus the tokens."""
    folder = make_tokenizer_folder(config=config, post_processor=post_processor)
    ours, hf = Tokenizer.from_folder(folder), hf_tokenizer_for(folder)
    assert ours.add_bos_token == bool(config.get("add_bos_token"))
    assert ours.add_eos_token == bool(config.get("add_eos_token"))
    for text in ("Hello", f"{USER}hi 你好", ""):
        plain = hf.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == plain
        expected = [ours.bos_token_id] * adds_bos + plain + [ours.eos_token_id] * adds_eos
        assert ours.encode(text) == expected
        if "add_bos_token" not in config and "add_eos_token" not in config:
            assert ours.encode(text) == hf.encode(text)


def test_tokens_declared_only_in_config_are_added(make_tokenizer_folder, hf_tokenizer_for):
    flags = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    config = {
        "added_tokens_decoder": {
            "515": {"content": "<｜place▁holder｜>", "special": True, **flags},
            "516": {"content": "<extra>", "special": False, **flags},
        },
        "pad_token": {"content": "<｜▁pad▁｜>", "__type": "AddedToken"},
    }
    folder = make_tokenizer_folder(config=config)
    ours, hf = Tokenizer.from_folder(folder), hf_tokenizer_for(folder)
    text = "a<｜place▁holder｜>b<extra>c<｜▁pad▁｜>"
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.token_to_id("<｜place▁holder｜>") == 515 and ours.token_to_id("<extra>") == 516
    assert ours.pad_token_id is not None and ours.pad_token_id in ids
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=True) == "ab<extra>c"


def test_special_tokens_map_file_is_a_fallback(make_tokenizer_folder):
    folder = make_tokenizer_folder(config={"bos_token": None, "eos_token": None})
    special_tokens_map = {"bos_token": BOS, "eos_token": {"content": EOS}}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_tokens_map), encoding="utf-8")
    tok = Tokenizer.from_folder(folder)
    assert (tok.bos_token, tok.eos_token) == (BOS, EOS)


def test_folder_without_config_still_loads(make_tokenizer_folder):
    folder = make_tokenizer_folder()
    (folder / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_folder(folder)
    assert tok.bos_token is None
    assert tok.encode("Hello") == Tokenizer.from_folder(make_tokenizer_folder()).encode("Hello")


def test_keep_special_tokens_when_skipping(tokenizer):
    text = f"{BOS}{THINK_START}r{THINK_END}c{TOOL_CALLS_BEGIN}x{EOS}"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "rcx"
    kept = tokenizer.decode(ids, skip_special_tokens=True, keep_special_tokens=STREAM_MARKERS)
    assert kept == f"{THINK_START}r{THINK_END}c{TOOL_CALLS_BEGIN}x"
    assert tokenizer.decode(ids, skip_special_tokens=False, keep_special_tokens=STREAM_MARKERS) == text


def test_truncation_in_tokenizer_json_is_ignored(make_tokenizer_folder):
    folder = make_tokenizer_folder()
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    data["truncation"] = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    assert len(Tokenizer.from_folder(folder).encode("Hello world, this is long")) > 2


@pytest.mark.parametrize("ids", [[-1], [10**9], [1.5], ["3"], [True], [0, 1, 515]])
def test_decode_rejects_ids_outside_the_vocabulary(tokenizer, ids):
    with pytest.raises(InvalidInputError, match="not an id"):
        tokenizer.decode(ids)


def test_encode_rejects_non_text(tokenizer):
    with pytest.raises(InvalidInputError, match="must be a str"):
        tokenizer.encode(b"bytes")


def test_missing_or_corrupt_files_are_checkpoint_errors(make_tokenizer_folder, tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    folder = make_tokenizer_folder()
    (folder / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer.json").write_text('{"model": 3}', encoding="utf-8")
    with pytest.raises(CheckpointError, match="cannot load"):
        Tokenizer.from_folder(folder)


def test_bad_special_token_entry_is_a_checkpoint_error(make_tokenizer_folder):
    with pytest.raises(CheckpointError, match="bos_token"):
        Tokenizer.from_folder(make_tokenizer_folder(config={"bos_token": 7}))


def test_added_tokens_in_tokenizer_json_are_honoured(make_tokenizer_folder, hf_tokenizer_for):
    folder = make_tokenizer_folder(added_tokens=[AddedToken("New York", normalized=False)])
    ours, hf = Tokenizer.from_folder(folder), hf_tokenizer_for(folder)
    assert ours.encode("I love New York!") == hf.encode("I love New York!")
    assert ours.token_to_id("New York") in ours.encode("I love New York!")
