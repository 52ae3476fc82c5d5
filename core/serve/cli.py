"""`deepinfer-serve` / `deepinfer serve`: flags, start-up checks, and uvicorn with a SIGTERM drain.

Start-up refuses, before loading anything, every flag whose feature does not exist yet or that the chosen
backend cannot honour, listing all such problems at once: nothing is silently ignored. SIGTERM (and the
first Ctrl-C) drains: new requests get 503, in-flight ones have --drain-timeout seconds to finish, the rest
are aborted, then the process exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from deepinfer.engine.heap import freeze_startup_heap
from deepinfer.errors import ConfigError, DeepInferError

API_KEY_ENV = "DEEPINFER_API_KEY"
# Backends whose MLA attention is the FlashMLA-style paged kernel (cuda_sm100's Triton kernels).
FLASHMLA_BACKENDS = frozenset({"cuda_sm100"})
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}

logger = logging.getLogger("deepinfer.serve")


def parse_size(text: str) -> int:
    """Bytes from "17179869184", "16GiB", "512 MiB", "1.5GB"."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or a unit: KiB, MiB, GiB, GB, ...)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model-path", help="Hugging Face checkpoint folder of a DeepSeek V2/V3/R1 model "
                   "(default: the embedded model, once the package ships one)")
    g.add_argument("--served-model-name", nargs="+", help="name(s) clients use in `model` (default: the folder name)")
    g.add_argument("--backend", help="backend name (default: $DEEPINFER_BACKEND, else auto)")
    g.add_argument("--precision", choices=["bf16", "fp8", "fp4"], help="weight precision (default: the checkpoint's)")
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="activation dtype (default: the model's)")
    g.add_argument("--max-model-len", type=_positive_int, help="context window (default: the model's)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=256, help="sequences per batch")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=4096, help="tokens per engine step")
    g.add_argument("--kv-cache-memory", type=parse_size, help="KV-cache size, e.g. 16GiB (default: a fraction of free memory)")
    g.add_argument("--kv-cache-fraction", type=float, default=0.9, help="fraction of free memory for the KV cache")
    g.add_argument("--kv-cache-dtype", choices=["bf16", "fp16", "fp32", "fp8_e4m3"], help="KV-cache storage dtype")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--batch-invariant", action="store_true", help="bit-identical results whatever the batch")
    g.add_argument("--enforce-eager", action="store_true", help="never replay decode steps from CUDA graphs")
    g.add_argument("--cuda-graph-max-batch-size", type=_positive_int, default=256,
                   help="largest decode batch captured in a CUDA graph (larger ones run eagerly)")
    g.add_argument("--no-overlap-scheduling", dest="overlap_scheduling", action="store_false",
                   help="wait for each step's sampled tokens before scheduling the next")
    g = p.add_argument_group("parallelism and kernels")
    g.add_argument("--tensor-parallel-size", type=_positive_int, default=1)
    g.add_argument("--expert-parallel-size", type=_positive_int, default=1,
                   help="ranks sharing the routed experts, attention data-parallel (spawns the local ranks; under "
                        "torchrun, joins its processes and rank 0 serves HTTP)")
    g.add_argument("--enable-eplb", action="store_true", help="expert-parallel load balancing: replicate and move hot experts")
    g.add_argument("--eplb-window-size", type=_positive_int, default=1000, help="engine steps of expert load EPLB looks at")
    g.add_argument("--eplb-step-interval", type=int, default=3000,
                   help="rebalance every this many steps when that improves balance (0: only on imbalance)")
    g.add_argument("--eplb-imbalance-threshold", type=float,
                   help="also rebalance when the busiest GPU's expert load over the mean exceeds this (e.g. 1.3)")
    g.add_argument("--num-redundant-experts", type=int, default=0,
                   help="extra expert slots per MoE layer for replicas of hot experts (needs --enable-eplb)")
    g.add_argument("--enable-flashmla", action="store_true", help="FlashMLA-style attention kernels")
    g.add_argument("--enable-deepep", action="store_true", help="DeepEP all-to-all for expert parallelism")
    g.add_argument("--speculative-engine", choices=["none", "mtp", "dspark"], default="none",
                   help="speculative decoding: the checkpoint's MTP layer chained, or the DSpark drafter")
    g.add_argument("--num-speculative-tokens", type=_positive_int,
                   help="draft tokens per step (default: 1 for mtp, the drafter's block for dspark)")
    g.add_argument("--dspark-model", help="DSpark drafter folder (default: <model>/dspark)")
    g.add_argument("--dspark-confidence-threshold", type=float,
                   help="static DSpark admission threshold on the calibrated survival, in [0, 1] (0 verifies whole "
                        "blocks; default: the hardware-aware prefix scheduler)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests allowed to wait beyond the running batch; more get 503 + Retry-After")
    g.add_argument("--max-request-body-bytes", type=parse_size, default=8 << 20, help="larger bodies get 413")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer-serve", description="OpenAI-compatible server for DeepSeek-family models")
    add_serve_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def unsupported_features(args: argparse.Namespace) -> list[str]:
    """Every flag this build cannot honour, each with the reason (empty when all is well)."""
    problems = []
    if args.tensor_parallel_size > 1:
        problems.append(f"--tensor-parallel-size {args.tensor_parallel_size}: tensor parallelism is not implemented "
                        "yet (the engine runs on one device); use 1")
    if args.expert_parallel_size > 1 and args.speculative_engine != "none":
        problems.append(f"--expert-parallel-size {args.expert_parallel_size} with --speculative-engine: not supported "
                        "together yet (expert-parallel ranks must run the same MoE forwards every step)")
    if args.enable_eplb and args.expert_parallel_size < 2:
        problems.append("--enable-eplb: balances experts across ranks; needs --expert-parallel-size >= 2")
    if args.num_redundant_experts and not args.enable_eplb:
        problems.append("--num-redundant-experts: the balancer places the replicas; needs --enable-eplb")
    if args.num_redundant_experts < 0 or args.eplb_step_interval < 0:
        problems.append("--num-redundant-experts and --eplb-step-interval must be >= 0")
    if args.eplb_imbalance_threshold is not None and args.eplb_imbalance_threshold < 1.0:
        problems.append(f"--eplb-imbalance-threshold {args.eplb_imbalance_threshold}: busiest/mean load, so >= 1.0")
    if args.enable_deepep:
        problems.append("--enable-deepep: DeepEP all-to-all is not integrated yet (and needs expert parallelism)")
    if args.speculative_engine != "dspark":
        for flag, value in (("--dspark-confidence-threshold", args.dspark_confidence_threshold),
                            ("--dspark-model", args.dspark_model)):
            if value is not None:
                problems.append(f"{flag}: needs --speculative-engine dspark (got {args.speculative_engine})")
    if args.num_speculative_tokens is not None and args.speculative_engine == "none":
        problems.append("--num-speculative-tokens: needs --speculative-engine mtp or dspark")
    if args.dspark_confidence_threshold is not None and not 0.0 <= args.dspark_confidence_threshold <= 1.0:
        problems.append(f"--dspark-confidence-threshold {args.dspark_confidence_threshold}: must be in [0, 1]")
    if args.enable_flashmla:
        from deepinfer.registry import resolve_backend_name

        try:
            backend = resolve_backend_name(args.backend)
        except DeepInferError as err:
            backend = f"<{err}>"
        if backend not in FLASHMLA_BACKENDS:
            problems.append(f"--enable-flashmla: backend {backend!r} has no FlashMLA attention kernels "
                            f"(available on: {', '.join(sorted(FLASHMLA_BACKENDS))})")
    return problems


def serve_config_from_args(args: argparse.Namespace, model_path: str) -> Any:
    from pathlib import Path

    from deepinfer.serve.config import ServeConfig

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    names = tuple(args.served_model_name or [Path(model_path).resolve().name or model_path])
    return ServeConfig(model_path=model_path, served_model_names=names, host=args.host, port=args.port, api_key=api_key,
                       max_queued_requests=args.max_queued_requests, max_request_body_bytes=args.max_request_body_bytes,
                       drain_timeout=args.drain_timeout, speculative_engine=args.speculative_engine)


def build_app_from_args(args: argparse.Namespace) -> Any:
    """Check the flags, load the engine and build the FastAPI app (raises DeepInferError with the reason)."""
    problems = unsupported_features(args)
    if problems:
        raise ConfigError("unsupported option(s):\n  " + "\n  ".join(problems))
    if args.model_path is None:
        from deepinfer.serve.default_model import default_model_path

        model_path = str(default_model_path())
    else:
        model_path = args.model_path
    config = serve_config_from_args(args, model_path)

    from deepinfer.config import EngineConfig
    from deepinfer.engine.async_engine import AsyncLLMEngine
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.serve.app import create_app
    from deepinfer.serve.engine_client import ServingEngine
    from deepinfer.serve.metrics import ServerMetrics

    engine_config = EngineConfig(
        model=model_path, backend=args.backend, precision=args.precision,
        dtype=None if args.dtype == "auto" else args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, kv_cache_fraction=args.kv_cache_fraction,
        kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, batch_invariant=args.batch_invariant,
        enforce_eager=args.enforce_eager, cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
        overlap_scheduling=args.overlap_scheduling,
        load_mtp=args.speculative_engine == "mtp",  # MTP weights serve only MTP drafting
        progress=sys.stderr.isatty(),
        speculative_engine=None if args.speculative_engine == "none" else args.speculative_engine,
        num_speculative_tokens=args.num_speculative_tokens, dspark_model=args.dspark_model,
        dspark_confidence_threshold=args.dspark_confidence_threshold,
        expert_parallel_size=args.expert_parallel_size, enable_eplb=args.enable_eplb,
        eplb_window_size=args.eplb_window_size, eplb_step_interval=args.eplb_step_interval,
        eplb_imbalance_threshold=args.eplb_imbalance_threshold, num_redundant_experts=args.num_redundant_experts,
    )
    expert_parallel = None
    if engine_config.expert_parallel_size > 1:
        from deepinfer.engine.ep_serving import launch

        expert_parallel = launch(engine_config)
        if expert_parallel.front is None:
            return None  # a torchrun follower rank: it has followed rank 0 until the server shut down
        llm = expert_parallel.front
    else:
        llm = LLMEngine.from_config(engine_config)
    if llm.tokenizer is None:
        if expert_parallel is not None:
            expert_parallel.close()
        raise ConfigError(f"{model_path} has no tokenizer.json: the server needs the model's tokenizer")
    metrics = ServerMetrics(engine_stats=llm.stats)
    serving = ServingEngine(AsyncLLMEngine(llm), metrics, max_queued_requests=config.max_queued_requests)
    app = create_app(serving, config)
    app.state.expert_parallel = expert_parallel  # closed by run() once the server stops
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM / first SIGINT drains the engine, and which then exits normally (status 0)
    instead of re-raising the signal as uvicorn does."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]):
        super().__init__(config)
        self._on_drain = on_drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # second Ctrl-C: stop waiting
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_drain)
        self.should_exit = True  # uvicorn stops accepting connections and waits for the open ones


def _stop_on_group_failure(front, server: uvicorn.Server, every_s: float = 1.0) -> None:
    """An expert-parallel group that lost a rank cannot serve again (every request already got an error):
    stop the server, so that it exits (status 1) for a supervisor to restart, instead of answering 503s."""
    while not server.should_exit:
        if front.failure() is not None:
            logger.error("expert-parallel group failed (%s): stopping the server", front.failure())
            server.should_exit = True
            return
        time.sleep(every_s)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app_from_args(args)
    except DeepInferError as err:
        print(f"deepinfer-serve: error: {err}", file=sys.stderr)
        return 2
    if app is None:
        return 0  # an expert-parallel follower rank (torchrun) whose server has shut down
    serving, config = app.state.serving, app.state.config
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=args.log_level, lifespan="on",
        # Backstop after our own drain (which aborts what is left at drain_timeout).
        timeout_graceful_shutdown=config.drain_timeout + 10, timeout_keep_alive=5,
    )
    server = DrainingServer(uv_config, on_drain=lambda: serving.begin_drain(config.drain_timeout))
    # The start-up heap (model, graphs, tokenizer) lives as long as the server: moved out of the collector's
    # reach, so that a full collection walks only what requests allocate (it cost ~100 ms every ~100 decode
    # steps at 256 sequences; benchmarks/host_overhead.py --gc-freeze).
    freeze_startup_heap()
    expert_parallel = getattr(app.state, "expert_parallel", None)
    if expert_parallel is not None:
        threading.Thread(target=_stop_on_group_failure, args=(expert_parallel.front, server), daemon=True,
                         name="deepinfer-ep-watch").start()
    try:
        server.run()
    finally:
        if expert_parallel is not None:
            expert_parallel.close()  # release the follower ranks
    failed = expert_parallel is not None and expert_parallel.front.failure()
    if failed:
        logger.error("shut down after an expert-parallel failure: %s", failed)
        logging.shutdown()
        os._exit(1)  # not a normal exit: the engine's step thread may still wait on the lost rank's collectives
    if not server.started:
        return 1  # e.g. the port was taken: uvicorn has logged why
    logger.info("shut down cleanly")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
