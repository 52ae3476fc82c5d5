"""Malformed requests get the right 4xx with OpenAI's error body and leave the server healthy; API keys; body
size limit (413); a full queue (503 + Retry-After)."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return {"model": "tiny-v3", "messages": USER, "max_tokens": 4, **fields}


# (name, method, path, body: dict | str | bytes | None, status, param, code)
MALFORMED = [
    ("invalid JSON", "POST", CHAT, b'{"messages": [', 400, None, None),
    ("not UTF-8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400, None, None),
    ("JSON array", "POST", CHAT, b"[1, 2]", 400, None, None),
    ("empty body", "POST", CHAT, b"", 400, None, None),
    ("no messages", "POST", CHAT, {"model": "tiny-v3"}, 400, "messages", None),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400, "messages", None),
    ("bad role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role", None),
    ("message without content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0", None),
    ("messages not a list", "POST", CHAT, chat(messages="hello"), 400, "messages", None),
    ("image part", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, None, None),
    ("negative max_tokens", "POST", CHAT, chat(max_tokens=-1), 400, "max_tokens", None),
    ("zero max_tokens", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("huge max_tokens", "POST", CHAT, chat(max_tokens=10**9), 400, "max_tokens", "context_length_exceeded"),
    ("huge max_completion_tokens", "POST", CHAT, chat(max_completion_tokens=10**6), 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("temperature too high", "POST", CHAT, chat(temperature=2.5), 400, "temperature", None),
    ("temperature negative", "POST", CHAT, chat(temperature=-0.1), 400, "temperature", None),
    ("top_p above 1", "POST", CHAT, chat(top_p=1.5), 400, "top_p", None),
    ("n zero", "POST", CHAT, chat(n=0), 400, "n", None),
    ("presence_penalty out of range", "POST", CHAT, chat(presence_penalty=5), 400, "presence_penalty", None),
    ("seed not a number", "POST", CHAT, chat(seed="abc"), 400, "seed", None),
    ("unknown model", "POST", CHAT, chat(model="gpt-9"), 400, "model", "model_not_found"),
    ("unknown parameter", "POST", CHAT, chat(frobnicate=1), 400, "frobnicate", None),
    ("chat prompt too long", "POST", CHAT, chat(messages=[{"role": "user", "content": "Hello world " * 400}]),
     400, "messages", "context_length_exceeded"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400, None, None),
    ("too many top_logprobs", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", None),
    ("stream_options without stream", "POST", CHAT, chat(stream_options={"include_usage": True}), 400, None, None),
    ("empty stop string", "POST", CHAT, chat(stop=[""]), 400, None, None),
    ("tool_choice names an unknown tool", "POST", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}),
     400, None, None),
    ("tool_choice without tools", "POST", CHAT, chat(tool_choice="required"), 400, None, None),
    ("logit_bias key not a token id", "POST", CHAT, chat(logit_bias={"five": 10}), 400, "logit_bias", None),
    ("logit_bias value out of range", "POST", CHAT, chat(logit_bias={"5": 150}), 400, "logit_bias.5", None),
    ("logit_bias token outside vocabulary", "POST", COMPLETIONS, {"prompt": "Hi", "logit_bias": {"1000000": 1}},
     400, None, None),
    ("json response_format", "POST", CHAT, chat(response_format={"type": "json_object"}), 400, "response_format", None),
    ("min_tokens above max_tokens", "POST", CHAT, chat(min_tokens=10), 400, None, None),
    ("max_draft_tokens zero", "POST", CHAT, chat(max_draft_tokens=0), 400, "max_draft_tokens", None),
    ("extra_body not an object", "POST", CHAT, chat(extra_body=[1]), 400, "extra_body", None),
    ("extra_body conflicts", "POST", CHAT, chat(top_k=5, extra_body={"top_k": 6}), 400, "extra_body.top_k", None),
    ("extra_body bad value", "POST", CHAT, chat(extra_body={"top_k": "many"}), 400, "top_k", None),
    ("reserved chat_template_kwargs", "POST", CHAT, chat(chat_template_kwargs={"tokenize": True}), 400,
     "chat_template_kwargs", None),
    ("completion without prompt", "POST", COMPLETIONS, {"max_tokens": 3}, 400, "prompt", None),
    ("completion empty prompt list", "POST", COMPLETIONS, {"prompt": []}, 400, None, None),
    ("completion prompt of no tokens", "POST", COMPLETIONS, {"prompt": "", "add_special_tokens": False}, 400, "prompt", None),
    ("completion token outside vocabulary", "POST", COMPLETIONS, {"prompt": [1, 2, 10**6]}, 400, "prompt", None),
    ("completion prompt too long", "POST", COMPLETIONS, {"prompt": [5] * 600}, 400, "prompt", "context_length_exceeded"),
    ("completion logprobs too many", "POST", COMPLETIONS, {"prompt": "Hi", "logprobs": 50}, 400, "logprobs", None),
    ("completion suffix", "POST", COMPLETIONS, {"prompt": "Hi", "suffix": "end"}, 400, "suffix", None),
    ("completion best_of", "POST", COMPLETIONS, {"prompt": "Hi", "best_of": 3}, 400, None, None),
    ("GET on a POST route", "GET", CHAT, None, 405, None, "method_not_allowed"),
    ("unknown route", "POST", "/v1/embeddings", {"input": "x"}, 404, None, "not_found"),
    ("unknown model to retrieve", "GET", "/v1/models/nope", None, 404, "model", "model_not_found"),
]


def send(client: httpx.Client, method: str, path: str, body) -> httpx.Response:
    if body is None:
        return client.request(method, path)
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers={"content-type": "application/json"})
    return client.request(method, path, json=body)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("name,method,path,body,status,param,code", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request(http, name, method, path, body, status, param, code):
    error = assert_openai_error(send(http, method, path, body), status)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_server_healthy_after_malformed_requests(server, http):
    for _, method, path, body, status, _, _ in MALFORMED:
        assert send(http, method, path, body).status_code == status
    assert http.get("/health").json() == {"status": "ok"}
    ok = http.post(CHAT, json=chat())
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    stats = server.wait_idle()
    assert stats.free_blocks == stats.num_blocks and server.app.state.serving.active_requests == 0
    metrics = http.get("/metrics").text
    assert 'deepinfer_http_requests_total{endpoint="/v1/chat/completions",status="400"}' in metrics
    assert 'status="500"' not in metrics


# ----- a guarded server: API key, small body limit, a queue of 0 beyond 2 running sequences -------------------

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def guarded(make_server):
    return make_server(api_key=KEY, max_request_body_bytes=4096, max_num_seqs=2, max_queued_requests=0)


def test_api_key_required(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Bearer"},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            r = c.post(CHAT, json=chat(), headers=headers)
            assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert_openai_error(c.get("/v1/models"), 401)
        good = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.post(CHAT, json=chat(), headers=good).status_code == 200
        # Health checks and scrapes stay open.
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_api_key_off_accepts_anything(server):
    r = httpx.post(server.url + CHAT, json=chat(), headers={"Authorization": "Bearer whatever"}, timeout=60)
    assert r.status_code == 200


def test_api_key_from_environment(monkeypatch):
    from deepinfer.serve.cli import parse_args, serve_config_from_args

    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    assert serve_config_from_args(parse_args(["--model-path", "/m"]), "/m").api_key == "from-env"
    assert serve_config_from_args(parse_args(["--model-path", "/m", "--api-key", "flag"]), "/m").api_key == "flag"


def test_oversized_body_is_413(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    big = chat(messages=[{"role": "user", "content": "x" * 5000}])
    with httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as c:
        assert assert_openai_error(c.post(CHAT, json=big), 413)["code"] == "request_too_large"

        def chunks():  # no Content-Length: chunked transfer, caught while reading
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]

        assert_openai_error(c.post(CHAT, content=chunks()), 413)
    with httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as c:
        assert c.post(CHAT, json=chat()).status_code == 200


def test_full_queue_is_503_with_retry_after(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    # n=4 on a 2-sequence batch: each request runs long enough to still hold its place below.
    long = {"prompt": "Hello", "n": 4, "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as a, \
            httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as b, \
            httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as c:
        with a.stream("POST", COMPLETIONS, json=long) as first, b.stream("POST", COMPLETIONS, json=long) as second:
            assert first.status_code == 200 and second.status_code == 200
            refused = c.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
            assert assert_openai_error(refused, 503)["code"] == "server_overloaded"
            assert refused.headers["retry-after"] == "1"
            # A batch that does not fit as a whole is refused as a whole.
            assert c.post(COMPLETIONS, json={"prompt": ["a", "b", "c"], "max_tokens": 2}).status_code == 503
    stats = guarded.wait_idle()
    assert stats.free_blocks == stats.num_blocks
    with httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as c:
        assert c.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_out_of_memory_fails_the_request_not_the_server(make_server):
    """A step that runs the device out of memory (forced here: on the GPU the forward raises it) answers its
    request with a 500 and OpenAI's error body, streamed or not; the server stays healthy and serves on."""
    import torch

    srv = make_server()
    runner = srv.engine.runner
    real = runner.execute

    def execute(batch, *args, **kwargs):
        if batch.num_tokens > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.25 GiB")
        return real(batch, *args, **kwargs)

    runner.execute = execute  # set before any request: the engine thread reads it at its next step
    long = {"model": "tiny-v3", "prompt": [5] * 150, "max_tokens": 4}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post(COMPLETIONS, json=long)
        assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]
        streamed = client.post(COMPLETIONS, json={**long, "stream": True}).text
        assert "out of memory" in streamed and streamed.rstrip().endswith("data: [DONE]")
        ok = client.post(COMPLETIONS, json={"model": "tiny-v3", "prompt": [5, 6, 7], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert client.get("/health").status_code == 200
    stats = srv.wait_idle()
    assert stats.free_blocks == stats.num_blocks
