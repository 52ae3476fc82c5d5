"""Load generator for an OpenAI-compatible server, in the style of `vllm bench serve`.

    deepinfer bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 20 \
        --input-len 256 --output-len 128 [--max-concurrency 32] [--endpoint chat|completions]

Requests arrive as a Poisson process at --request-rate (gamma with --burstiness != 1; "inf" sends them all at
once), optionally capped at --max-concurrency in flight. Prompts are random words ("random", a fresh prompt
per request) or one repeated prompt ("fixed", which a prefix cache serves); lengths vary uniformly by
--range-ratio around --input-len / --output-len. Output lengths are exact: requests set ignore_eos. Token
counts come from the server's usage (stream_options.include_usage).

Reported: request and token throughput, and mean / median / P90 / P99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency between streamed chunks (ITL) and end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex bright jars of "
          "mixed pickles under purple skies near rivers and mountains in autumn").split()


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (without /v1)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    p.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"), help="default: $DEEPINFER_API_KEY")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default: inf, all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 = Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    p.add_argument("--dataset", choices=["random", "fixed"], default="random")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (about one token each)")
    p.add_argument("--output-len", type=int, default=64, help="tokens to generate per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1-r) .. len*(1+r)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let requests stop at eos")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--result-json", help="also write the results here")
    p.add_argument("--quiet", action="store_true", help="print only the summary table")


def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(count)]


def make_requests(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) per request."""
    rng = random.Random(args.seed)
    inputs = _lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
    outputs = _lengths(rng, args.output_len, args.range_ratio, args.num_prompts)
    fixed = " ".join(rng.choice(_WORDS) for _ in range(args.input_len))
    out = []
    for n_in, n_out in zip(inputs, outputs):
        prompt = fixed if args.dataset == "fixed" else " ".join(rng.choice(_WORDS) for _ in range(n_in))
        out.append((prompt, n_out))
    return out


async def _one(client: Any, args: argparse.Namespace, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    chunks = 0
    try:
        async with client.stream("POST", path, json=body, timeout=args.timeout) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return result
                if event.get("usage"):
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                    result.output_tokens = event["usage"]["completion_tokens"]
                if not any(_has_output(c) for c in event.get("choices", [])):
                    continue
                now = time.perf_counter()
                chunks += 1
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    except Exception as err:  # noqa: BLE001 - a failed request is a result, not a crash of the benchmark
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = last is not None
    if not result.ok:
        result.error = "no output"
    return result


def _has_output(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is not None:
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
    return bool(choice.get("text"))


async def _first_model(client: Any) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    requests = make_requests(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=limit + 8, max_keepalive_connections=limit + 8)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits, timeout=args.timeout) as client:
        model = args.model or await _first_model(client)
        gate = asyncio.Semaphore(limit)
        rng = random.Random(args.seed + 1)

        async def limited(prompt: str, max_tokens: int) -> RequestResult:
            async with gate:
                return await _one(client, args, model, prompt, max_tokens)

        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, args, model)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p90": pct(0.90), "p99": pct(0.99)}


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace, model: str) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": model,
        "endpoint": args.endpoint,
        "num_prompts": len(results),
        "successful": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration if duration else 0.0,
        "ttft_s": _stats([r.ttft for r in ok]),
        "tpot_s": _stats(tpot),
        "itl_s": _stats([gap for r in ok for gap in r.itl]),
        "e2e_s": _stats([r.e2e for r in ok]),
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(name: str, value: Any) -> None:
        lines.append(f"{name:<42}{value:>18}")

    row("Model / endpoint:", f"{s['model']} / {s['endpoint']}")
    row("Successful requests:", s["successful"])
    row("Failed requests:", s["failed"])
    row("Request rate (req/s):", s["request_rate"])
    row("Max concurrency:", s["max_concurrency"] or "-")
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    for key, title in (("ttft_s", "Time to First Token"), ("tpot_s", "Time per Output Token (excl. 1st token)"),
                       ("itl_s", "Inter-token Latency"), ("e2e_s", "End-to-end Latency")):
        lines.append("{:-^60}".format(f" {title} "))
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {short} (ms):", f"{s[key][stat] * 1e3:.2f}")
    if s["errors"]:
        lines.append("{:-^60}".format(" Errors "))
        lines += [f"  {e}" for e in s["errors"]]
    lines.append("=" * 60)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        print("deepinfer bench serve: error: --num-prompts must be at least 1", file=sys.stderr)
        return 2
    summary = asyncio.run(run_benchmark(args))
    print(format_summary(summary))
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer bench serve", description=__doc__.split("\n\n")[0])
    add_bench_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
