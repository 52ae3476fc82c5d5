"""Streaming under load and abandonment: the DeepInfer example client, 200 concurrent streams, and client
disconnects (streamed and not) freeing their cache blocks, checked through /metrics and the engine's stats."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx

from conftest import REASONING


def deepinfer_example_client(base_url: str, messages: list[dict]) -> tuple[str, str, httpx.Headers]:
    """The DeepInfer documentation's client, unchanged: extra parameters travel inside `extra_body`."""
    payload = {
        "model": "tiny-v3",
        "messages": messages,
        "stream": True,
        "max_tokens": 64,
        "temperature": 0.6,
        "extra_body": {"dspark_speculation": True, "max_draft_tokens": 8},
    }
    content, reasoning = "", ""
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=payload, timeout=60) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            delta = json.loads(data)["choices"][0]["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
        headers = response.headers
    return content, reasoning, headers


def test_deepinfer_example_client(server):
    content, reasoning, headers = deepinfer_example_client(server.url, [{"role": "user", "content": "Weather?"}])
    assert reasoning == REASONING
    assert content.startswith("function")
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-deepinfer-speculation"] == "off"


def parse_stream(body: str) -> list[dict]:
    """Well-formedness: only `data: ` events separated by blank lines, JSON each, `[DONE]` last."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def check_stream(chunks: list[dict], n: int, max_tokens: int) -> None:
    assert chunks and all("error" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    finishes = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            assert ch["index"] not in finishes, "a chunk after the choice finished"
            if ch["finish_reason"] is not None:
                finishes[ch["index"]] = ch["finish_reason"]
    assert sorted(finishes) == list(range(n))
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and 0 < usage["completion_tokens"] <= n * max_tokens


def test_200_concurrent_streams(server):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
        if i % 2:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"question {i}"}]}
        else:
            path, body = "/v1/completions", {"prompt": f"Hello world {i}", "n": 1 + i % 3}
        body.update(stream=True, max_tokens=4, stream_options={"include_usage": True}, seed=i)
        r = await client.post(path, json=body)
        return r.status_code, r.text, body

    async def run_all():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run_all())
    for status, text, body in results:
        assert status == 200, text
        check_stream(parse_stream(text), body.get("n", 1), 4)
    stats = server.wait_idle()
    assert stats.free_blocks == stats.num_blocks and stats.running == 0 and stats.waiting == 0
    assert server.app.state.serving.active_requests == 0


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_disconnect_mid_stream_frees_blocks(server):
    total = metric(server, "deepinfer_cache_blocks_total")
    assert metric(server, "deepinfer_cache_blocks_free") == total
    aborted_before = _aborted(server)
    body = {"prompt": "Hello", "n": 2, "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got == 3:
                    break
            # The request holds cache blocks while it runs.
            assert metric(server, "deepinfer_cache_blocks_free") < total
            assert metric(server, "deepinfer_server_active_requests") == 1
        # Leaving the `with` closes the connection mid-stream.
    assert wait_for(lambda: metric(server, "deepinfer_cache_blocks_free") == total
                    and metric(server, "deepinfer_server_active_requests") == 0)
    assert _aborted(server) == aborted_before + 1
    assert server.engine.stats().free_blocks == server.engine.stats().num_blocks


def test_disconnect_before_a_non_streamed_reply_aborts(server):
    """A raw socket sends a long non-streamed request and hangs up once the engine runs it."""
    aborted_before = _aborted(server)
    body = json.dumps({"prompt": "Hello", "n": 2, "max_tokens": 480, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: metric(server, "deepinfer_server_active_requests") == 1)
        assert metric(server, "deepinfer_cache_blocks_free") < metric(server, "deepinfer_cache_blocks_total")
    assert wait_for(lambda: _aborted(server) == aborted_before + 1)
    stats = server.wait_idle()
    assert stats.free_blocks == stats.num_blocks and server.app.state.serving.active_requests == 0


def _aborted(server) -> float:
    try:
        return metric(server, 'deepinfer_request_finished_total{finish_reason="abort"}')
    except AssertionError:
        return 0.0


def test_metrics_exposition(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60).raise_for_status()
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("deepinfer_http_requests_total", "deepinfer_time_to_first_token_seconds_count",
                 "deepinfer_inter_token_latency_seconds_count", "deepinfer_e2e_request_latency_seconds_count",
                 "deepinfer_num_requests_waiting", "deepinfer_num_requests_running", "deepinfer_kv_cache_usage_ratio",
                 "deepinfer_prefix_cache_hit_rate", "deepinfer_cache_blocks_free", "deepinfer_generation_tokens_total"):
        assert name in text, name
    assert metric(server, "deepinfer_time_to_first_token_seconds_count") >= 1
    assert metric(server, 'deepinfer_request_finished_total{finish_reason="length"}') >= 1
    assert metric(server, "deepinfer_num_requests_waiting") == 0
