"""Stream parsers: chunk-boundary invariance, recovery of known messages, and the pinned malformed-output rules."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.text import ChatStreamParser, ReasoningParser, ToolCallParser, parse_chat_output, prompt_opens_reasoning
from deepinfer.text.markers import (
    THINK_END,
    THINK_START,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)

B, E, CB, CE, SEP = TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP
PARSER_MODES = {
    "reasoning_and_tools": {"reasoning": True, "tools": True},
    "opened_reasoning_and_tools": {"reasoning": True, "starts_in_reasoning": True, "tools": True},
    "tools_only": {"tools": True},
    "reasoning_only": {"reasoning": True},
}


def call_text(name: str, arguments: str, kind: str = "function") -> str:
    return f"{CB}{kind}{SEP}{name}\n```json\n{arguments}\n```{CE}"


def run(text_chunks: list[str], **mode):
    """Parse chunks as a stream; return the final result and every delta (incl. finish's)."""
    parser = ChatStreamParser(tool_call_id_factory=map("call_{}".format, itertools.count()).__next__, **mode)
    deltas = [parser.feed(chunk) for chunk in text_chunks] + [parser.finish()]
    return parser, deltas


def outcome(text_chunks: list[str], **mode):
    parser, deltas = run(text_chunks, **mode)
    # The deltas must add up to the final message: content, reasoning, and per call id, name once, arguments.
    assert "".join(d.content for d in deltas) == parser.content
    assert "".join(d.reasoning_content for d in deltas) == parser.reasoning_content
    streamed: dict[int, dict] = {}
    for d in deltas:
        for piece in d.tool_calls:
            if piece.id is not None:
                assert piece.index == len(streamed) and piece.name
                streamed[piece.index] = {"id": piece.id, "name": piece.name, "arguments": piece.arguments}
            else:
                assert piece.name is None and piece.index in streamed
                streamed[piece.index]["arguments"] += piece.arguments
    calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in parser.tool_calls]
    assert [streamed[i] for i in range(len(streamed))] == calls
    return parser.reasoning_content, parser.content, calls


def split_at(text: str, cuts) -> list[str]:
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


WELL_FORMED = (
    f"{THINK_START}\nLet me look it up.\n{THINK_END}\n\nChecking.{B}"
    + call_text("get_weather", '{"city": "Paris", "days": [1, 2]}')
    + "\n"
    + call_text("get_time", "{}")
    + E
)
SAMPLES = [
    WELL_FORMED,
    "plain answer with <think> in the middle and a ` backtick",
    f"  {THINK_START}r{THINK_END}c{THINK_START}not reasoning{THINK_END}",
    f"{B}{CB}function{SEP}f\n```json\n{{\"a\": \"x```y\"}}\n  ```  {CE}{E}tail",
    f"{B}{CB}function{SEP}f\n{{\"a\": 1}}{CE}\n\n{CB}function{SEP}g{CE}{E}",
    f"text {CB}function{SEP}solo\n```json\n{{}}\n```{CE}",
    f"{B}{CB}function{SEP}f\n```json\n{{\"city\": Paris\n```{CE}{E}",  # bad JSON
    f"{B}{CB}function{SEP}f\n```json\n{{\"city\": \"Par",  # unterminated arguments
    f"Hi{B}{CB}function{SEP}get_wea",  # unterminated header
    f"{B}{CB}func\ntion{SEP}x\n{{}}{CE}{E}",  # broken header
    f"{B}" + call_text("f", "{}") + f"oops{E}after",  # garbage between calls
    f"{B}{CB}function{SEP}f\n```json\n{{}}\n```{E}",  # missing call end
    f"<｜tool▁calls▁begun<｜tool<think{THINK_END}``` {B} ",
    f"{THINK_START}unterminated reasoning {B}" + call_text("f", "{}"),
]


@pytest.mark.parametrize("mode", sorted(PARSER_MODES))
@pytest.mark.parametrize("sample", range(len(SAMPLES)))
def test_every_single_split_gives_the_whole_text_result(mode, sample):
    text, options = SAMPLES[sample], PARSER_MODES[mode]
    whole = outcome([text], **options)
    assert outcome(list(text), **options) == whole  # one character per chunk
    for i in range(len(text) + 1):
        assert outcome([text[:i], text[i:]], **options) == whole, f"split at {i}: {text[:i]!r} | {text[i:]!r}"


FRAGMENTS = [
    THINK_START, THINK_END, B, E, CB, CE, SEP, "function", "get_weather", "\n", " ", "  ", "```json\n", "```", "`",
    "{", "}", '"city"', ": ", '"Paris"', "hello", "中文😀", "<", "<｜tool", "<think", "</thi", "｜>", "x",
]
fragment_texts = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=fragment_texts, data=st.data(), mode=st.sampled_from(sorted(PARSER_MODES)))
def test_random_multi_splits_give_the_whole_text_result(text, data, mode):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert outcome(split_at(text, cuts), **PARSER_MODES[mode]) == outcome([text], **PARSER_MODES[mode])


@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join))
def test_random_texts_every_single_split(text):
    options = PARSER_MODES["reasoning_and_tools"]
    whole = outcome([text], **options)
    for i in range(len(text) + 1):
        assert outcome([text[:i], text[i:]], **options) == whole


plain_text = st.text(alphabet=st.sampled_from("ab <>｜`{}\"\n中😀:,"), max_size=30)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None)
@given(
    reasoning=st.none() | plain_text,
    content=plain_text,
    calls=st.lists(st.tuples(names, st.dictionaries(st.text(max_size=6), json_values, max_size=3)), max_size=3),
    data=st.data(),
)
def test_known_message_is_recovered_from_its_deepseek_rendering(reasoning, content, calls, data):
    """Independent reference: render a known (reasoning, content, calls) message the way DeepSeek-V3 writes it,
    cut it anywhere, and check the parser gives back exactly that message."""
    if reasoning is None and content.lstrip().startswith(("<think>", "<")):
        content = "." + content  # the output would otherwise open like a reasoning block
    text = (f"{THINK_START}{reasoning}{THINK_END}" if reasoning is not None else "") + content
    if calls:
        text += B + "\n".join(call_text(name, json.dumps(args, ensure_ascii=False)) for name, args in calls) + E
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    got_reasoning, got_content, got_calls = outcome(split_at(text, cuts), reasoning=True, tools=True)
    assert got_reasoning == (reasoning or "")
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == [(n, a) for n, a in calls]


# --- pinned rules for malformed and look-alike output ----------------------------------------------------------


def parsed(text: str, **mode):
    mode = mode or {"reasoning": True, "tools": True}
    out = parse_chat_output(text, tool_call_id_factory=lambda: "call_x", **mode)
    return out.reasoning_content, out.content, [(c.name, c.arguments) for c in out.tool_calls]


def test_bad_json_arguments_are_passed_on_raw():
    text = f"{B}{CB}function{SEP}get_weather\n```json\n{{\"city\": Paris\n```{CE}{E}"
    assert parsed(text) == ("", "", [("get_weather", '{"city": Paris')])


def test_unterminated_arguments_keep_the_call_with_what_arrived():
    parser, _ = run([f"Sure{B}{CB}function{SEP}get_weather\n```json\n{{\"city\": \"Par"], tools=True)
    assert parser.content == "Sure"
    assert [(c.name, c.arguments) for c in parser.tool_calls] == [("get_weather", '{"city": "Par')]
    assert parser.finish_reason("length") == "length"
    assert parser.finish_reason("stop") == "tool_calls"
    # A closing fence without the end marker is still removed.
    assert parsed(f"{CB}function{SEP}f\n```json\n{{}}\n```\n") == ("", "", [("f", "{}")])


def test_unterminated_or_broken_header_is_content():
    assert parsed(f"Hi{B}{CB}function{SEP}get_wea") == ("", f"Hi{B}{CB}function{SEP}get_wea", [])
    assert parsed(f"{B}{CB}func\ntion{SEP}x\n{{}}{CE}{E}") == ("", f"{B}{CB}func\ntion{SEP}x\n{{}}{CE}{E}", [])
    assert parsed(f"{B}{CB}function{SEP}\n{{}}{CE}") == ("", f"{B}{CB}function{SEP}\n{{}}{CE}", [])  # no name
    assert parsed(f"{B}{CB}function") == ("", f"{B}{CB}function", [])


def test_text_between_calls_and_after_the_section_is_content():
    text = f"{B}" + call_text("f", "{}") + f"oops{E}" + call_text("g", "[]")
    assert parsed(text) == ("", f"oops{E}", [("f", "{}"), ("g", "[]")])
    assert parsed(f"{B}" + call_text("f", "{}") + f"\n{E} bye") == ("", " bye", [("f", "{}")])
    assert parsed(f"{B}\n{E}") == ("", "", [])  # an empty section is just syntax
    assert parsed(f"{B}" + call_text("f", "{}") + "\n ") == ("", "", [("f", "{}")])  # ended before the section end
    assert parsed(f"Hi{B}\n") == ("", f"Hi{B}\n", [])  # a section no call follows


def test_lenient_forms_of_the_call_syntax():
    assert parsed(f"{CB}function{SEP}f\n{{\"a\": 1}}{CE}") == ("", "", [("f", '{"a": 1}')])  # no fence, no section
    assert parsed(f"{B}{CB}function{SEP}ping{CE}{E}") == ("", "", [("ping", "")])  # no arguments at all
    assert parsed(f"{B}{CB}function{SEP}f\n```json\n{{}}\n```{E}") == ("", "", [("f", "{}")])  # missing call end
    two = f"{B}{CB}function{SEP}f\n```json\n1\n```{CB}function{SEP}g\n```json\n2\n```{CE}{E}"
    assert parsed(two) == ("", "", [("f", "1"), ("g", "2")])  # call end skipped between calls


def test_look_alike_markers_are_content():
    text = "<｜tool▁calls▁begun, <｜tool and ｜> and <think"
    assert parsed(text) == ("", text, [])
    assert parsed(f"x{THINK_END}y") == ("", f"x{THINK_END}y", [])


def test_reasoning_rules():
    assert parsed(f"{THINK_START}a{THINK_END}b") == ("a", "b", [])
    assert parsed(f" \n{THINK_START}a{THINK_END}b") == ("a", "b", [])
    assert parsed(f"b{THINK_START}a{THINK_END}") == ("", f"b{THINK_START}a{THINK_END}", [])
    assert parsed(f"{THINK_START}a{THINK_END}b{THINK_START}c{THINK_END}") == ("a", f"b{THINK_START}c{THINK_END}", [])
    assert parsed(f"{THINK_START}never closed {B}") == (f"never closed {B}", "", [])
    assert parsed("<thinking>x") == ("", "<thinking>x", [])
    assert parsed("<thi") == ("", "<thi", [])
    assert parsed("a</think>b", reasoning=True, starts_in_reasoning=True) == ("a", "b", [])
    assert parsed("abc", reasoning=True, starts_in_reasoning=True) == ("abc", "", [])
    assert parsed(f"{THINK_START}a{THINK_END}b", tools=True) == ("", f"{THINK_START}a{THINK_END}b", [])  # reasoning off


def test_tool_calls_inside_reasoning_stay_reasoning():
    text = f"{THINK_START}maybe " + call_text("f", "{}") + f"{THINK_END}ok"
    assert parsed(text) == ("maybe " + call_text("f", "{}"), "ok", [])


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning(f"<｜User｜>hi<｜Assistant｜>{THINK_START}\n")
    assert not prompt_opens_reasoning(f"<｜Assistant｜>{THINK_START}a{THINK_END}b<｜User｜>")
    assert not prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜>")


def test_openai_delta_shapes_and_finish_reason():
    parser = ChatStreamParser(reasoning=True, tools=True, tool_call_id_factory=lambda: "call_1")
    first = parser.feed(f"{THINK_START}r{THINK_END}Hi{B}{CB}function{SEP}f\n```json\n{{\"a\"")
    rest = parser.feed(": 1}\n```" + CE + E)
    assert first.to_openai() == {
        "reasoning_content": "r",
        "content": "Hi",
        "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
        ],
    }
    assert rest.to_openai() == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert parser.finish().is_empty()
    assert parser.finish_reason("stop") == "tool_calls"
    assert [c.to_openai() for c in parser.tool_calls] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert ChatStreamParser().feed(f"{THINK_START}x").to_openai() == {"content": f"{THINK_START}x"}
    assert ChatStreamParser().finish_reason("stop") == "stop"


def test_component_parsers_directly():
    reasoning = ReasoningParser()
    assert reasoning.feed("<thi") == ("", "") and reasoning.feed("nk>a</th") == ("a", "")
    assert reasoning.in_reasoning and reasoning.feed("ink>b") == ("", "b") and reasoning.finish() == ("", "")
    tools = ToolCallParser(id_factory=lambda: "id")
    delta = tools.feed(f"x{CB}function{SEP}f\n")
    assert delta.content == "x" and [(d.id, d.name) for d in delta.tool_calls] == [("id", "f")]
    assert tools.feed("[1]\n``").tool_calls[0].arguments == "[1]"  # the possible closing fence waits
    assert tools.feed("`" + CE).tool_calls == [] and tools.finish().content == ""
    assert [(c.name, c.arguments) for c in tools.tool_calls] == [("f", "[1]")]
