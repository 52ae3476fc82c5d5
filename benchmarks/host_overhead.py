"""Host time of one engine decode step with many running sequences, the model forward stubbed out.

    python benchmarks/host_overhead.py [--seqs 256] [--context 1024] [--steps 200] [--profile]
                                       [--no-overlap] [--no-prefix-caching] [--plan]

On the H200 (benchmarks/RESULTS.md, issue 10) a batch-256 decode step took 20.1 ms against 14.6 ms of graph
replay: with overlapped scheduling the step lasts max(host, device), so the engine's host work bounds it.
This script measures that host work on the CPU alone: it builds a real LLMEngine (scheduler, block
manager, runner, sampler, overlap, outputs) around a STUB MODEL (below) whose forward costs a few tensor
ops, so what remains of a step is host time. The stub's own time is measured and subtracted.

Prefill runs first (every request gets its first token); then --warmup steps, then --steps timed decode
steps of all --seqs sequences at once, which print the median and mean host ms per step. --profile runs
the timed steps under cProfile and prints the top functions by own time and by cumulative time.
--plan also times cuda_sm100's attention re-planning (plan_mla(..., into=captured plan), what a graph
replay runs each step) for the same batch on CPU tensors, which the stub model's reference plan does not
include. --gc-freeze shows what freezing the start-up heap does to the worst step (full collections).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

import torch

# The model's shape only sizes the cache (576 latent values per token) and names the eos id; the vocabulary
# is small because on the GPU a batch's sampling is device work, which this host benchmark leaves out.
CONFIG = dict(
    model_type="deepseek_v3", vocab_size=1024, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=1.0, norm_topk_prob=True, max_position_embeddings=36864,
    bos_token_id=0, eos_token_id=1, topk_method="noaux_tc", scoring_func="sigmoid",
)


class StubModel:
    """STUB standing in for DeepseekModel (benchmark only, never used by the library): no layers, one cache
    layer, and a forward of a few tensor ops whose logits make the next token a fixed function of the input
    token (greedy decoding then walks a deterministic, varied path). It times itself so the caller can
    subtract its cost from a step."""

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16):
        self.config = config
        self.embed_tokens = torch.empty(1, 1, dtype=dtype)  # read for the activation (and cache) dtype
        self.num_cache_layers = 1
        self.seconds = 0.0
        self.last_batch = None  # the AttentionBatch of the latest forward (to time attention planning on)

    def forward(self, ids: torch.Tensor, ctx) -> torch.Tensor:
        started = time.perf_counter()
        self.last_batch = ctx.plan.batch
        hidden = ids.to(torch.float32)[:, None]  # [T, 1]: the token id itself
        self.seconds += time.perf_counter() - started
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        vocab = self.config.vocab_size
        nxt = (hidden[:, 0].long() * 7 + 3) % (vocab - 2) + 2  # never 0 or 1 (bos / eos)
        logits = torch.zeros(hidden.shape[0], vocab, dtype=torch.float32).scatter_(1, nxt[:, None], 1.0)
        self.seconds += time.perf_counter() - started
        return logits


def build_engine(args):
    from deepinfer.config import EngineConfig, ModelConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.registry import load_backend

    config = ModelConfig.from_hf_dict(dict(CONFIG, max_position_embeddings=args.context + args.gen + 64))
    backend = load_backend("reference")
    model = StubModel(config)
    max_len = args.context + args.gen + 1
    blocks = args.seqs * (-(-max_len // 64))
    ec = EngineConfig(model="stub", backend="reference", max_num_seqs=args.seqs, max_num_batched_tokens=args.chunk,
                      kv_cache_memory=blocks * 64 * 576 * 2, enable_prefix_caching=not args.no_prefix_caching,
                      overlap_scheduling=not args.no_overlap, progress=False)
    return LLMEngine(model, backend, ec, max_model_len=max_len), model


def prefill(engine, args) -> None:
    from deepinfer.engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", torch.randint(2, CONFIG["vocab_size"], (args.context,), generator=gen).tolist(), params)
    first: set[str] = set()
    while len(first) < args.seqs:
        for out in engine.step():
            if out.outputs[0].token_ids:
                first.add(out.request_id)


def time_steps(engine, model: StubModel, steps: int, profiler: cProfile.Profile | None) -> list[float]:
    """Host milliseconds of each step: its wall time minus the stub forward's."""
    host = []
    for _ in range(steps):
        before = model.seconds
        if profiler is not None:
            profiler.enable()
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        if profiler is not None:
            profiler.disable()
        host.append(1e3 * (elapsed - (model.seconds - before)))
    return host


def time_attention_plan(engine, model: StubModel) -> None:
    """cuda_sm100's per-step re-plan of a captured decode graph's attention plan, on CPU tensors, for the
    batch of the last timed step."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels' schedule is built only where they can run
    from deepinfer.attention import AttentionPlan
    from deepinfer.backends.cuda_sm100.attention import plan_mla

    batch, spec = model.last_batch, engine.runner.spec
    device = torch.device("cpu")
    captured = plan_mla(batch, spec, device, max_seq_len=engine.max_model_len)
    for label, fn in (("AttentionPlan.build (reference plan)", lambda: AttentionPlan.build(batch, spec, device)),
                      ("plan_mla(into=captured) (graph replay)", lambda: plan_mla(batch, spec, device, into=captured))):
        fn()
        times = []
        for _ in range(50):
            started = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - started))
        print(f"  {label}, {batch.num_seqs} sequences: median {statistics.median(times):.2f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    p.add_argument("--no-overlap", action="store_true", help="synchronous steps instead of overlapped scheduling")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    p.add_argument("--top", type=int, default=25, help="profile rows to print")
    p.add_argument("--plan", action="store_true", help="also time cuda_sm100's attention re-plan for this batch")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after prefill: what a server could do once started (vLLM does), so that full "
                        "collections stop walking every long-lived object (the max column)")
    args = p.parse_args()
    # Prefill hands out first tokens over several steps: the earliest requests decode meanwhile, and must not
    # finish before the last timed step.
    args.gen = args.warmup + args.steps + -(-args.seqs * args.context // args.chunk) + 8

    # The few small tensor ops left (stub forward, sampling, index copies) stand in for kernel launches on a
    # GPU host; intra-op threads would add their own synchronisation, which a GPU host does not pay.
    torch.set_num_threads(1)
    engine, model = build_engine(args)
    started = time.perf_counter()
    prefill(engine, args)
    print(f"{args.seqs} sequences of {args.context} prompt tokens prefilled in {time.perf_counter() - started:.1f} s "
          f"(overlap {'off' if args.no_overlap else 'on'}, prefix caching {'off' if args.no_prefix_caching else 'on'}, "
          f"python {sys.version.split()[0]}, torch {torch.__version__})", flush=True)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    time_steps(engine, model, args.warmup, None)
    if engine.scheduler.num_running != args.seqs:
        raise SystemExit(f"expected {args.seqs} running sequences, found {engine.scheduler.num_running}")
    profiler = cProfile.Profile() if args.profile else None
    host = time_steps(engine, model, args.steps, profiler)
    p90 = statistics.quantiles(host, n=10)[-1]
    print(f"host ms per decode step at {args.seqs} sequences: median {statistics.median(host):.2f}, "
          f"mean {statistics.mean(host):.2f}, p90 {p90:.2f}, min {min(host):.2f}, max {max(host):.2f} "
          f"({args.steps} steps, stub forward excluded)", flush=True)
    if args.plan:
        time_attention_plan(engine, model)
    if profiler is not None:
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(args.top)
            print(f"--- profile of {args.steps} steps, by {key} ---")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:20000])


if __name__ == "__main__":
    main()
