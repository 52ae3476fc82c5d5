"""`deepinfer-serve --expert-parallel-size 2 --enable-eplb` as a real process: it spawns its follower rank,
answers like a single-process engine, and SIGTERM shuts both ranks down cleanly (exit status 0). A follower
that dies mid-generation fails the request in flight and stops the server (exit status 1) instead of leaving it
waiting in collectives."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from deepinfer import LLM, SamplingParams
from deepinfer.models import embedded_model_path

PROMPT = "def fibonacci(n):"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "deepinfer.serve.cli", "--port", str(port), "--backend", "reference",
           "--dtype", "float32", "--kv-cache-memory", "8MiB", "--expert-parallel-size", "2", *extra,
           "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode(errors="replace"))
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("the expert-parallel server did not start within 120 s")
        time.sleep(0.5)


def test_expert_parallel_server_matches_one_process():
    proc, url = _start_server("--enable-eplb", "--num-redundant-experts", "2", "--eplb-step-interval", "2")
    try:
        body = {"model": "deepseek_v3_tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "n": 2}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        texts = [c["text"] for c in out["choices"]]
        assert out["usage"]["completion_tokens"] == 20
        # Pause for a clean shutdown: SIGTERM to the server process only (its follower ignores signals and
        # waits for rank 0's release).
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    llm = LLM(embedded_model_path(), backend="reference", dtype="float32", kv_cache_memory=8 << 20, progress=False)
    want = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, n=2))[0]
    assert texts == [c.text for c in want.outputs]


def _follower_pid(server_pid: int) -> int:
    """The spawned rank among the server's child processes (not multiprocessing's resource tracker)."""
    children = open(f"/proc/{server_pid}/task/{server_pid}/children").read().split()
    ranks = [int(pid) for pid in children
             if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()
             and b"resource_tracker" not in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(ranks) == 1, children
    return ranks[0]


def test_a_dead_follower_fails_the_request_and_stops_the_server():
    proc, url = _start_server()
    try:
        body = {"model": "deepseek_v3_tiny", "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True,
                "ignore_eos": True, "n": 2}  # two completions: one is likely on the follower
        started, events = time.monotonic(), []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                events.append(line)
                if len(events) == 3:  # generating on both ranks: the follower dies mid-step
                    os.kill(_follower_pid(proc.pid), signal.SIGKILL)
        assert time.monotonic() - started < 60
        errors = [line for line in events if line.startswith("data: {\"error\"")]
        assert len(errors) == 1 and "rank 1 exited" in errors[0], events[-4:]  # an OpenAI error event, then [DONE]
        assert proc.wait(timeout=60) == 1, proc.stdout.read().decode(errors="replace")
        log = proc.stdout.read().decode(errors="replace")
        assert "expert-parallel" in log and "rank 1 exited" in log, log[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
