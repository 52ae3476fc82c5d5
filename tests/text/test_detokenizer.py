"""Incremental detokenizer: deltas always concatenate to the full decode and never split a UTF-8 character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.errors import InvalidInputError
from deepinfer.text import STREAM_MARKERS, IncrementalDetokenizer
from deepinfer.text.markers import BOS, EOS, THINK_END, THINK_START, TOOL_CALL_BEGIN

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DECODE_MODES = [
    {"skip_special_tokens": False},
    {"skip_special_tokens": True},
    {"skip_special_tokens": True, "keep_special_tokens": STREAM_MARKERS},
]


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


BYTE_TO_CHAR = _byte_to_char()


def byte_ids(tokenizer, text: str) -> list[int]:
    """One id per UTF-8 byte of `text`: every multi-byte character is split across ids."""
    return [tokenizer.token_to_id(BYTE_TO_CHAR[b]) for b in text.encode("utf-8")]


def stream(tokenizer, ids: list[int], cuts: list[int], **mode) -> list[str]:
    """Deltas from adding `ids` in groups cut at `cuts`, then finish()."""
    detok = IncrementalDetokenizer(tokenizer, **mode)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    deltas = [detok.add(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return [*deltas, detok.finish()]


@st.composite
def ids_and_cuts(draw, tokenizer):
    ids = draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40))
    cuts = draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)))
    return ids, cuts


@pytest.mark.parametrize("mode", DECODE_MODES, ids=["keep_specials", "skip_specials", "skip_but_keep_markers"])
def test_deltas_concatenate_to_decode_for_random_ids(tokenizer, mode):
    @PROPERTY
    @given(data=ids_and_cuts(tokenizer))
    def check(data):
        ids, cuts = data
        assert "".join(stream(tokenizer, ids, cuts, **mode)) == tokenizer.decode(ids, **mode)

    check()


@st.composite
def text_ids_and_cuts(draw, tokenizer):
    """Byte-split text (so cuts fall inside multi-byte characters) with special tokens between characters."""
    pieces = draw(
        st.lists(
            st.one_of(
                # U+FFFD itself is excluded: the check below reads it as a half-shown character.
                st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\ufffd"), min_size=1, max_size=4),
                st.sampled_from(["中", "😀", "é", "👍🏽", BOS, EOS, THINK_START, THINK_END, TOOL_CALL_BEGIN]),
            ),
            max_size=12,
        )
    )
    ids: list[int] = []
    for piece in pieces:
        token = tokenizer.token_to_id(piece)
        ids += [token] if token is not None and piece in tokenizer.special_tokens else byte_ids(tokenizer, piece)
    cuts = draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)))
    return "".join(pieces), ids, cuts


@pytest.mark.parametrize("mode", DECODE_MODES, ids=["keep_specials", "skip_specials", "skip_but_keep_markers"])
def test_deltas_never_hold_half_a_character(tokenizer, mode):
    @PROPERTY
    @given(data=text_ids_and_cuts(tokenizer))
    def check(data):
        text, ids, cuts = data
        deltas = stream(tokenizer, ids, cuts, **mode)
        assert "".join(deltas) == tokenizer.decode(ids, **mode)
        # Valid UTF-8 split anywhere: no delta may show a replacement character for a half-received one.
        assert all("\ufffd" not in d for d in deltas)
        if not mode["skip_special_tokens"]:
            assert "".join(deltas) == text

    check()


def test_multibyte_character_is_emitted_once_complete(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = byte_ids(tokenizer, "a中😀")
    assert [detok.add(i) for i in ids] == ["a", "", "", "中", "", "", "", "😀"]
    assert detok.finish() == ""
    assert detok.ids == ids


def test_incomplete_character_at_the_end_comes_out_on_finish(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = byte_ids(tokenizer, "ok中")[:-1]
    assert detok.add(ids) == "ok"
    assert detok.finish() == "\ufffd" == tokenizer.decode(ids)[-1]
    assert detok.finish() == ""


def test_special_tokens_skipped_kept_or_shown(tokenizer):
    ids = tokenizer.encode(f"{BOS}{THINK_START}hm{THINK_END}Hi{EOS}")
    expectations = [f"{BOS}{THINK_START}hm{THINK_END}Hi{EOS}", "hmHi", f"{THINK_START}hm{THINK_END}Hi"]
    for mode, expected in zip(DECODE_MODES, expectations):
        detok = IncrementalDetokenizer(tokenizer, **mode)
        assert "".join(detok.add(i) for i in ids) + detok.finish() == expected


def test_bad_ids_and_use_after_finish_are_typed_errors(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    with pytest.raises(InvalidInputError):
        detok.add(tokenizer.vocab_size)
    with pytest.raises(InvalidInputError):
        detok.add([-3])
    assert detok.add([]) == ""
    detok.finish()
    with pytest.raises(InvalidInputError, match="after finish"):
        detok.add(1)
