"""Pieces of the server without a server: the special-token filter, token bytes, extra_body lifting, sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.serve.errors import BadRequestError
from deepinfer.serve.parsing import lift_extra_body
from deepinfer.serve.text_output import SpecialTextFilter
from deepinfer.text.markers import find_first

DROP = ["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜begin▁of▁sentence｜>"]
PIECES = st.sampled_from(DROP + ["<", "<｜", "a", "b c", "<think>", "｜>", "\n", "é", "<｜User"])


def remove_left_to_right(text: str) -> str:
    """Reference: cut the earliest dropped token, then go on in the rest (as skipping tokens would)."""
    out = []
    while (hit := find_first(text, DROP)) is not None:
        out.append(text[:hit[0]])
        text = text[hit[0] + len(hit[1]):]
    return "".join(out) + text


@settings(max_examples=200, deadline=None)
@given(st.lists(PIECES, max_size=12), st.lists(st.integers(0, 200), max_size=6))
def test_filter_is_chunking_invariant(pieces, cuts):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    f = SpecialTextFilter(DROP)
    out = "".join(f.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])) + f.finish()
    assert out == remove_left_to_right(text)


def test_filter_holds_back_only_possible_prefixes():
    f = SpecialTextFilter(["<｜User｜>"])
    assert f.feed("hello <｜Us") == "hello "
    assert f.feed("er｜> world") == " world"
    assert f.feed("<｜x") == "<｜x"
    assert f.finish() == ""


def test_token_bytes_round_trip(checkpoint):
    from deepinfer.serve.text_output import TokenTexts
    from deepinfer.text import Tokenizer

    tok = Tokenizer.from_folder(checkpoint)
    texts = TokenTexts(tok)
    for text in ["café 你好 😀", "Hello world", '{"city": "Paris"}', "<think>x</think>"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(bytes(texts.get(i)[1]) for i in ids).decode() == text


def test_lift_extra_body():
    assert lift_extra_body({"a": 1, "extra_body": {"b": 2}}) == {"a": 1, "b": 2}
    assert lift_extra_body({"a": 1, "extra_body": {"a": 1}}) == {"a": 1}
    assert lift_extra_body({"a": 1}) == {"a": 1}
    assert lift_extra_body({"a": 1, "extra_body": None}) == {"a": 1}
    for bad in ({"extra_body": 3}, {"a": 1, "extra_body": {"a": 2}}, {"extra_body": {"extra_body": {}}}):
        with pytest.raises(BadRequestError):
            lift_extra_body(bad)
