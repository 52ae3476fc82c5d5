"""Start-up refusals, the `deepinfer serve` alias, the load generator, and the SIGTERM drain (a real process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import free_port, start_server


@pytest.mark.parametrize("flags,expected", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: tensor parallelism is not implemented"),
    (["--enable-eplb"], "--enable-eplb: balances experts across ranks"),
    (["--expert-parallel-size", "2", "--num-redundant-experts", "2"], "--num-redundant-experts: the balancer places"),
    (["--enable-deepep"], "--enable-deepep: DeepEP"),
    (["--enable-flashmla", "--backend", "reference"], "--enable-flashmla: backend 'reference' has no FlashMLA"),
    (["--dspark-confidence-threshold", "0.6"], "--dspark-confidence-threshold: needs --speculative-engine dspark"),
    (["--speculative-engine", "mtp", "--dspark-model", "x"], "--dspark-model: needs --speculative-engine dspark"),
    (["--speculative-engine", "dspark", "--dspark-confidence-threshold", "1.5"], "must be in [0, 1]"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens: needs --speculative-engine"),
])
def test_unsupported_flags_stop_startup(checkpoint, capsys, flags, expected):
    from deepinfer.serve.cli import main

    assert main(["--model-path", str(checkpoint), *flags]) == 2
    err = capsys.readouterr().err
    assert "unsupported option" in err and expected in err


def test_every_unsupported_flag_is_listed_at_once(capsys):
    from deepinfer.serve.cli import main

    assert main(["--model-path", "/nowhere", "--tensor-parallel-size", "2", "--enable-deepep",
                 "--dspark-confidence-threshold", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n  --") == 3


def test_without_model_path_the_embedded_model_is_served():
    from openai import OpenAI

    from deepinfer.models import embedded_model_path
    from deepinfer.serve.default_model import default_model_path

    assert default_model_path() == embedded_model_path()
    running = start_server(None, served_model_name="embedded")
    try:
        client = OpenAI(base_url=running.base_url, api_key="unused", max_retries=0)
        out = client.completions.create(model="embedded", prompt="def fibonacci(n):", max_tokens=16, temperature=0)
        assert out.choices[0].text and out.usage.completion_tokens == 16 or out.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "Write a loop"}],
                                              max_tokens=8)
        assert chat.choices[0].message.role == "assistant"
    finally:
        running.stop()


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    from deepinfer.serve.cli import main

    assert main(["--model-path", str(tmp_path), "--backend", "reference"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_deepinfer_serve_subcommand_shares_the_flags():
    from deepinfer.cli import build_parser

    args = build_parser().parse_args(["serve", "--model-path", "/m", "--port", "9001", "--max-queued-requests", "7"])
    assert args.command == "serve" and args.port == 9001 and args.max_queued_requests == 7
    args = build_parser().parse_args(["bench", "serve", "--num-prompts", "3"])
    assert args.num_prompts == 3


def test_gpu_path_flags():
    from deepinfer.cli import build_parser

    args = build_parser().parse_args(["serve", "--model-path", "/m"])
    assert (args.enforce_eager, args.cuda_graph_max_batch_size, args.overlap_scheduling) == (False, 256, True)
    args = build_parser().parse_args(["serve", "--model-path", "/m", "--enforce-eager", "--no-overlap-scheduling",
                                      "--cuda-graph-max-batch-size", "64"])
    assert (args.enforce_eager, args.cuda_graph_max_batch_size, args.overlap_scheduling) == (True, 64, False)


def test_size_flags():
    from deepinfer.serve.cli import parse_size

    assert parse_size("16GiB") == 16 << 30 and parse_size("512 MiB") == 512 << 20 and parse_size("1000") == 1000


def test_bench_serve_against_the_server(server, tmp_path, capsys):
    import argparse

    from deepinfer.serve.bench import add_bench_arguments, main, make_requests

    out = tmp_path / "bench.json"
    argv = ["--base-url", server.url, "--num-prompts", "12", "--request-rate", "200", "--max-concurrency", "6",
            "--input-len", "16", "--output-len", "8", "--range-ratio", "0.5", "--result-json", str(out)]
    assert main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["successful"] == 12 and summary["failed"] == 0
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    # ignore_eos makes output lengths exact.
    assert summary["total_output_tokens"] == sum(n for _, n in make_requests(parser.parse_args(argv)))
    assert 0 < summary["ttft_s"]["median"] <= summary["e2e_s"]["p99"]
    assert "Time to First Token" in capsys.readouterr().out
    chat = main(["--base-url", server.url, "--endpoint", "chat", "--num-prompts", "4", "--output-len", "4",
                 "--input-len", "8", "--dataset", "fixed", "--quiet"])
    assert chat == 0


def test_drain_timeout_aborts_what_is_left(make_server):
    """In-process drain with a zero timeout: the in-flight stream ends well formed (finish_reason abort)."""
    srv = make_server()
    body = {"prompt": "Hello", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            loop = srv.server.servers[0].get_loop()  # the server thread's event loop
            loop.call_soon_threadsafe(srv.app.state.serving.begin_drain, 0.0)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "abort"
        refused = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert client.get("/health").status_code == 503
    stats = srv.wait_idle()
    assert stats.free_blocks == stats.num_blocks


def test_sigterm_drains_and_exits_zero(checkpoint):
    """A real `deepinfer-serve` process: SIGTERM while a stream runs -> the stream completes, new connections are
    refused, exit status 0."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.serve.cli", "--model-path", str(checkpoint), "--port", str(port),
         "--backend", "reference", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--log-level", "warning",
         "--drain-timeout", "60"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        result: dict = {}
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        started.set()
                result["events"] = events

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        events = result["events"]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks)  # the whole reply arrived
        assert proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
