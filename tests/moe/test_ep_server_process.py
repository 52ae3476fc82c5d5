"""`deepinfer-serve --expert-parallel-size 2 --enable-eplb` as a real process: it spawns its follower rank,
answers like a single-process engine, and SIGTERM shuts both ranks down cleanly (exit status 0)."""

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


def test_expert_parallel_server_matches_one_process():
    port = _free_port()
    cmd = [sys.executable, "-m", "deepinfer.serve.cli", "--port", str(port), "--backend", "reference",
           "--dtype", "float32", "--kv-cache-memory", "8MiB", "--expert-parallel-size", "2", "--enable-eplb",
           "--num-redundant-experts", "2", "--eplb-step-interval", "2", "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the expert-parallel server did not start within 120 s"
            time.sleep(0.5)
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
