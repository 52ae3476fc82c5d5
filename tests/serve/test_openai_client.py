"""The official `openai` client against the real server: chat (plain, streamed), completions, models, tool calls
parsed from the model's own output, reasoning_content, usage in the last stream chunk, n, seed, stop, logprobs."""

from __future__ import annotations

import json

import openai
import pytest
from tokenizers import Tokenizer

from conftest import ANSWER, REASONING, TOOL_ARGS, WEATHER_TOOL

MODEL = "tiny-v3"
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_plain(client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=50)
    choice = r.choices[0]
    # Without tools the tool-call markers are special tokens, skipped; the reasoning is split off.
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert choice.message.content == 'functionget_weather\n```json\n{"city": "Paris"}\n```'
    assert choice.finish_reason == "stop"
    assert r.usage.completion_tokens == 13 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == MODEL and r.id.startswith("chatcmpl-")


def test_tool_calls_parsed(client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == REASONING
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_calls_streamed_with_usage_last(client):
    stream = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=[WEATHER_TOOL], stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    reasoning, calls, finish = "", {}, None
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for ch in chunk.choices:
            delta = ch.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            assert not delta.content
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or tc.id
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 13
    assert reasoning == REASONING and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(TOOL_ARGS)


def test_tool_round_trip(client):
    """The tool's result goes back; the model (scripted) answers after the tool outputs."""
    first = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=[WEATHER_TOOL]).choices[0].message
    messages = WEATHER + [first.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == ANSWER
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls


def test_chat_streamed_content(client):
    messages = WEATHER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": TOOL_ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len({c.id for c in chunks}) == 1


def test_named_tool_choice_forces_the_call(client):
    """A named tool_choice prefills the call's header: the reply is that call, whatever the model wanted."""
    r = client.chat.completions.create(
        model=MODEL, tools=[WEATHER_TOOL], max_tokens=5, temperature=0,
        messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                  {"role": "user", "content": "Weather?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=7, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    again = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=7, temperature=0)
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic
    stream = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
    assert stream[-1].usage.completion_tokens == 7


def test_completions_batch_n_seed_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "world"], n=2, max_tokens=4, seed=123,
                                  temperature=1.0, logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    same = client.completions.create(model=MODEL, prompt=["Hello", "world"], n=2, max_tokens=4, seed=123,
                                     temperature=1.0, logprobs=2)
    assert [c.text for c in same.choices] == [c.text for c in r.choices]
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


def test_echo_with_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("Hello")
    assert lp.token_logprobs[0] is None and len(lp.tokens) > 2


def test_echo_scores_prompts_chunk_by_chunk(make_server):
    """echo + logprobs with the prompt prefilled in chunks of 16: the stream sends each prompt token's
    log-probability once (as the non-streamed reply has them), and max_tokens 0 scores the prompt alone."""
    server = make_server(max_num_batched_tokens=16)
    prompt = "Hello world, what a day. " * 8
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        full = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0)
        lp = full.choices[0].logprobs
        n_prompt = full.usage.prompt_tokens
        assert n_prompt > 32 and len(lp.tokens) == n_prompt + 3
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1,
                                           temperature=0, stream=True))
        parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
        assert [t for p in parts for t in p.tokens] == lp.tokens
        assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs
        assert [o for p in parts for o in p.text_offset] == lp.text_offset
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text

        for stream in (False, True):
            scored = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, n=2,
                                          temperature=1.0, stream=stream)
            choices = ([ch for chunk in scored for ch in chunk.choices] if stream else scored.choices)
            for k in (0, 1):
                mine = [ch for ch in choices if ch.index == k]
                assert "".join(ch.text for ch in mine) == prompt
                assert [t for ch in mine if ch.logprobs for t in ch.logprobs.tokens] == lp.tokens[:n_prompt]
                assert [v for ch in mine if ch.logprobs for v in ch.logprobs.token_logprobs] == lp.token_logprobs[:n_prompt]
                assert mine[-1].finish_reason == "length"
            if not stream:
                assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n_prompt
        with pytest.raises(openai.BadRequestError, match="echo"):
            c.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_logit_bias_forces_and_bans(client, checkpoint):
    """OpenAI's logit_bias (token id strings -> bias) reaches the sampler: +100 makes a token every greedy pick
    (+50 on a second one loses to it), and -100 on the first hands every pick to the second."""
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    first, second = [i for i in range(40, tok.get_vocab_size()) if tok.decode([i]).strip().isalpha()][:2]
    for bias, want in (({first: 100, second: 50}, first), ({first: -100, second: 50}, second)):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                      logit_bias={str(t): b for t, b in bias.items()})
        assert r.choices[0].text == tok.decode([want] * 4)


def test_chat_logprobs_n_and_stop(client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER, n=2, logprobs=True, top_logprobs=2,
                                       max_completion_tokens=20, stop=["weather"])
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert choice.message.model_extra["reasoning_content"] == "Checking the "  # cut at the stop string
        content = choice.logprobs.content
        assert content[0].token == "<think>" and content[0].logprob == pytest.approx(0.0, abs=1e-3)
        assert len(content[0].top_logprobs) == 2


def test_extra_body_through_the_client(client):
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=WEATHER, max_tokens=3,
        extra_body={"top_k": 5, "dspark_speculation": True, "max_draft_tokens": 4})
    assert r.headers["x-deepinfer-speculation"] == "off"
    assert r.parse().usage.completion_tokens == 3


def test_bad_request_raises_typed_error(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=WEATHER, temperature=5)
    assert info.value.body["param"] == "temperature"
