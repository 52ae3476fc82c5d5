"""End to end on one GPU: a DeepSeek-V2-Lite-shaped MoE with random weights, DeepInfer vs transformers and the
roofline, in one run.

    python benchmarks/e2e.py [--precision bf16 fp8] [--backend cuda_sm100] [--no-peer] [--json OUT]
    python benchmarks/e2e.py --tiny --backend reference   # the same logic on a CPU-sized model

The model (hidden 2048, 27 layers, first dense, 64 routed experts top-6 + 2 shared, kv_lora 512, no q_lora,
vocabulary 102400: ~15.7B parameters) is built by transformers 5 on the GPU with its own random init, and
DeepInfer loads the same tensors from memory (FP8: quantised to 128x128 blocks at load).

Printed, per precision:
- expert-load spread of the router on a 4k-token prompt (max/mean tokens per expert, experts never chosen);
- decode tokens/s at batch 1, 32 and 256 with 1k and 16k contexts: requests with random prompts of that
  length are prefilled through the engine, then the engine's own steps (scheduling, CUDA-graph replay,
  sampling) are timed until every request has generated --gen tokens; next to the roofline: the bytes each
  step must read (weights of the attention, dense and shared layers, the routed experts a batch of that size
  touches in expectation, the LM head (bf16 in both precisions, as DeepSeek's FP8 checkpoints store it and the
  loader keeps it), and the latent cache) over the measured HBM bandwidth;
- time to first token for 4k and 32k prompts, next to the FLOP floor (linear layers + causal attention in
  the decompressed form) at the measured bf16 matmul rate;
- per decode cell also the median wall time of one engine step and the GPU time of one graph replay
  (their gap is host time the overlap did not hide);
- transformers `generate` (experts_implementation="grouped_mm", bf16, 1k-token prompts) at batch 1 and 32.
Cells whose latent cache does not fit the GPU are reported as such, not silently dropped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=1.0, norm_topk_prob=True, rms_norm_eps=1e-6,
    max_position_embeddings=36864, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)
TINY = dict(V2_LITE, vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
            num_experts_per_tok=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            max_position_embeddings=2048)


@dataclass(frozen=True)
class Shape:
    """Per-token parameter counts of the model, for the roofline."""

    attn: int  # per layer: q, kv_a, kv_b, o projections
    dense_mlp: int  # a dense layer's MLP
    expert: int  # one routed or shared expert
    layers: int
    dense_layers: int
    experts: int
    top_k: int
    shared: int
    vocab: int
    hidden: int
    heads: int
    qk_dim: int
    v_dim: int
    cache_bytes_per_token: int  # per layer

    @classmethod
    def of(cls, c: dict, kv_bytes: int) -> Shape:
        h, heads = c["hidden_size"], c["num_attention_heads"]
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        attn = (h * heads * qk + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
                + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * h)
        return cls(attn, 3 * h * c["intermediate_size"], 3 * h * c["moe_intermediate_size"], c["num_hidden_layers"],
                   c["first_k_dense_replace"], c["n_routed_experts"], c["num_experts_per_tok"], c["n_shared_experts"],
                   c["vocab_size"], h, heads, qk, c["v_head_dim"], kv_bytes)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def total_params(self) -> int:
        per_moe = self.experts * self.expert + self.shared * self.expert + self.hidden * self.experts
        return (self.layers * self.attn + self.dense_layers * self.dense_mlp + self.moe_layers * per_moe
                + 2 * self.vocab * self.hidden)

    def decode_bytes(self, batch: int, context: int, weight_bytes: float) -> float:
        """Bytes one decode step must read: every projection the batch touches once at weight_bytes a value, the
        LM head at 2 (bf16 in every precision: DeepSeek's FP8 checkpoints keep it so, and it is no quantised
        projection here either), the batch's embedding rows, and each sequence's cache."""
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** batch)  # expected distinct experts
        params = (self.layers * self.attn + self.dense_layers * self.dense_mlp
                  + self.moe_layers * (touched + self.shared) * self.expert)
        return (params * weight_bytes + self.vocab * self.hidden * 2 + batch * self.hidden * 2
                + batch * context * self.layers * self.cache_bytes_per_token)

    def prefill_flops(self, tokens: int) -> float:
        linear = 2 * tokens * (self.layers * self.attn + self.dense_layers * self.dense_mlp
                               + self.moe_layers * (self.top_k + self.shared) * self.expert)
        attention = self.layers * 2 * self.heads * (self.qk_dim + self.v_dim) * tokens * (tokens + 1) / 2
        return linear + attention + 2 * self.vocab * self.hidden  # the last token's logits


def build_transformers(shape: dict, device: str, dtype: torch.dtype, seed: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**shape)
    with torch.device(device):
        model = DeepseekV3ForCausalLM._from_config(cfg, dtype=dtype, experts_implementation="grouped_mm")
    return model.eval(), cfg


def build_engine(hf, cfg, args, precision: str | None, max_model_len: int):
    from deepinfer.config import EngineConfig, ModelConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.model.checkpoint import TensorDictCheckpoint
    from deepinfer.model.loader import load_model
    from deepinfer.registry import load_backend

    config = ModelConfig.from_hf_dict(cfg.to_dict())
    backend = load_backend(args.backend)
    dtype = torch.float32 if args.tiny and backend.device.type == "cpu" else torch.bfloat16
    started = time.perf_counter()
    model = load_model(TensorDictCheckpoint.from_transformers(hf), backend, config=config, precision=precision,
                       dtype=dtype, max_positions=max_model_len, progress=False)
    loaded = time.perf_counter() - started
    ec = EngineConfig(model="v2-lite-random", backend=args.backend, precision=precision, max_model_len=max_model_len,
                      max_num_seqs=max(args.batches), max_num_batched_tokens=args.chunk, kv_cache_dtype=args.kv_cache_dtype,
                      kv_cache_fraction=args.kv_cache_fraction, enable_prefix_caching=False, progress=False,
                      enforce_eager=args.enforce_eager)
    started = time.perf_counter()
    engine = LLMEngine(model, backend, ec, max_model_len=max_model_len)
    graphs = engine.runner.graphs
    print(f"  load {loaded:.1f} s; engine start {time.perf_counter() - started:.1f} s "
          f"(graphs: {'none' if graphs is None else f'{len(graphs.batch_sizes)} sizes in {graphs.capture_seconds:.1f} s'}); "
          f"cache {engine.num_cache_tokens} tokens ({engine.runner.spec.dtype})", flush=True)
    return engine


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def expert_spread(engine, prompt_len: int, gen: torch.Generator) -> str:
    """Route one prompt with load hooks on every MoE layer; summarise tokens per expert."""
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.model.moe import MoE

    layers = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, MoE)]
    counts = torch.zeros(len(layers), engine.config.n_routed_experts, dtype=torch.int64, device=engine.backend.device)

    def hook(i):
        return lambda ids: counts[i].index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))

    for i, moe in enumerate(layers):
        moe.load_hook = hook(i)
    try:
        vocab = engine.config.vocab_size
        engine.add_request("spread", torch.randint(2, vocab, (prompt_len,), generator=gen).tolist(),
                           SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    finally:
        for moe in layers:
            moe.load_hook = None
    c = counts.float()
    ratio = (c.max(1).values / c.mean(1))
    unused = int((counts == 0).sum())
    return (f"max/mean tokens per expert: median {ratio.median():.2f}, worst layer {ratio.max():.2f}; "
            f"experts never chosen: {unused} of {counts.numel()} (layer x expert)")


def run_decode(engine, batch: int, context: int, gen_tokens: int, gen: torch.Generator) -> tuple[float, float, int]:
    """(prefill seconds, decode tokens/s, decode steps) for `batch` requests of `context` random prompt tokens."""
    from deepinfer.engine.sampling_params import SamplingParams

    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{context}-{i}", torch.randint(2, vocab, (context,), generator=gen).tolist(), params)
    started = time.perf_counter()
    first: set[str] = set()
    while len(first) < batch:  # until every request has its first token (prefill, possibly mixed with decodes)
        for out in engine.step():
            if out.outputs[0].token_ids:
                first.add(out.request_id)
    sync(engine.backend.device)
    prefilled = time.perf_counter()
    before = engine.stats().generated_tokens
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    sync(engine.backend.device)
    elapsed = time.perf_counter() - prefilled
    return prefilled - started, (engine.stats().generated_tokens - before) / elapsed, steps


def graph_replay_ms(engine, batch: int) -> float | None:
    """GPU time of one decode graph replay at this batch size (its buffers as the last step left them)."""
    graphs = engine.runner.graphs
    size = None if graphs is None else graphs.size_for(batch)
    if size is None or engine.backend.device.type != "cuda":
        return None
    from gpu_timing import events_median

    return events_median(lambda: graphs.replay(size), 20)


def profile_eager_step(engine, batch: int, context: int, gen: torch.Generator, top: int = 25, host: bool = False) -> None:
    """Kernel time breakdown of one eager decode step (kernel time without the launch gaps a graph removes)."""
    from deepinfer.engine.sampling_params import SamplingParams

    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"prof-{i}", torch.randint(2, vocab, (context,), generator=gen).tolist(), params)
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        chunk = engine.engine_config.max_num_batched_tokens
        for _ in range(2 + batch * context // chunk):  # the prefill chunks, then a decode step to warm up
            engine.step()
        print_kernel_table(engine, lambda: (engine.step(), sync(engine.backend.device)), top, host)
    finally:
        engine.runner.graphs = graphs
        while engine.has_unfinished():
            engine.step()


def profile_graph_replay(engine, batch: int, replays: int = 5, top: int = 30) -> None:
    """Timeline of decode graph replays at this batch size: kernel time against the idle gaps between kernels
    (launch and ramp cost a graph still pays), and per kernel its mean duration and the mean gap before it."""
    graphs = engine.runner.graphs
    size = None if graphs is None else graphs.size_for(batch)
    if size is None or engine.backend.device.type != "cuda":
        print("  (no decode graph for this batch)")
        return
    graphs.replay(size)
    sync(engine.backend.device)
    acts = _gpu_activities(lambda: [graphs.replay(size) for _ in range(replays)], engine, ("kernel",))
    if not acts:
        print("  (the profiler saw no kernels inside the graph)")
        return
    # the pause between two replays is not the graph's: gaps of 50 us or more are left out
    _print_timeline(acts, replays, f"graph replay, batch {batch}", top, max_gap=50.0)
    _print_layer_chain(acts[len(acts) // replays:2 * len(acts) // replays], engine.config.num_hidden_layers)


def _print_layer_chain(acts: list[tuple[float, float, str]], layers: int) -> None:
    """One replay's kernels for two layers from the middle of the model, in launch order: start, duration and end
    (us from the first), and the time each adds to the path (as _print_timeline's column). A layer starts at the
    first kernel launched once a layer."""
    counts: dict[str, int] = {}
    for _, _, name in acts:
        counts[name] = counts.get(name, 0) + 1
    mark = next((name for _, _, name in acts if counts[name] == layers), None)
    if mark is None or layers < 2:
        return
    starts = [i for i, a in enumerate(acts) if a[2] == mark] + [len(acts)]
    lo, hi = starts[layers // 2], starts[min(layers // 2 + 2, layers)]
    t0, paths = acts[lo][0], _path_us(acts)
    print(f"  kernels of two layers from layer {layers // 2} (of {layers}): start, duration, end (us), path us")
    for (ts, dur, name), path in zip(acts[lo:hi], paths[lo:hi]):
        print(f"    {ts - t0:8.2f} {dur:7.2f} {ts + dur - t0:8.2f} {path:6.2f}  {name[:80]}")


def _path_us(acts: list[tuple[float, float, str]], max_gap: float = float("inf")) -> list[float]:
    """Each activity's time on the path: how much later it ends than every activity before it (0 when it ends
    earlier); after a pause of max_gap us or more (between steps), its own duration."""
    paths, last_end = [], None
    for ts, dur, _ in acts:
        path = dur if last_end is None else max(0.0, ts + dur - last_end)
        paths.append(path if path < max_gap + dur else dur)
        last_end = ts + dur if last_end is None else max(last_end, ts + dur)
    return paths


def profile_decode_steps(engine, batch: int, context: int, gen: torch.Generator, steps: int = 8, top: int = 30) -> None:
    """GPU timeline of whole engine decode steps (graph replay, sampling, the inputs' copies, under overlapped
    scheduling as served): what ran on the GPU per step, kernels and copies by name, and the idle time between
    them, which a graph replay's own timeline does not show."""
    from deepinfer.engine.sampling_params import SamplingParams

    if engine.backend.device.type != "cuda":
        print("  (no GPU: nothing to profile)")
        return
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"steps-{i}", torch.randint(2, vocab, (context,), generator=gen).tolist(), params)
    try:
        first: set[str] = set()
        while len(first) < batch:  # prefill, then a few decode steps to warm up
            first.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
        for _ in range(4):
            engine.step()
        sync(engine.backend.device)
        acts = _gpu_activities(lambda: [engine.step() for _ in range(steps)], engine,
                               ("kernel", "gpu_memcpy", "gpu_memset"))
        if acts:
            _print_timeline(acts, steps, f"engine decode steps, batch {batch}, context {context}", top)
    finally:
        while engine.has_unfinished():
            engine.step()


def _gpu_activities(fn, engine, categories: tuple[str, ...]) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of the GPU activities of these trace categories while fn() runs."""
    import json
    import tempfile

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        sync(engine.backend.device)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    return sorted((e["ts"], e["dur"], e["name"]) for e in events if e.get("cat") in categories)


def _print_timeline(acts: list[tuple[float, float, str]], per: int, title: str, top: int,
                    max_gap: float = float("inf")) -> None:
    """Busy time against the idle gaps between activities (gaps of max_gap us or more left out), per `per`
    (steps or replays), and per name its count, mean duration, the idle time before it, and its time on the
    path: how much later it ends than the activity before it. Under PDL a kernel starts early and waits, so its
    duration overlaps its predecessor's; the ends still come in stream order, and the path column adds up to
    the step."""
    stats: dict[str, list[float]] = {}
    busy = gaps = 0.0
    for i, ((ts, dur, name), path) in enumerate(zip(acts, _path_us(acts, max_gap))):
        gap = 0.0 if i == 0 else max(0.0, ts - (acts[i - 1][0] + acts[i - 1][1]))
        gap = gap if gap < max_gap else 0.0
        busy, gaps = busy + dur, gaps + gap
        row = stats.setdefault(name[:70], [0, 0.0, 0.0, 0.0])
        row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + dur, row[2] + gap, row[3] + path
    print(f"  {title}: {len(acts) / per:.0f} activities per step, "
          f"{busy / per:.0f} us of them + {gaps / per:.0f} us of gaps between them per step")
    print(f"  {'kernel / copy':<70} {'per step':>8} {'us each':>8} {'us/step':>8} {'gap us/step':>11} "
          f"{'path us/step':>12}")
    for name, (n, dur, gap, path) in sorted(stats.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:top]:
        print(f"  {name:<70} {n / per:>8.0f} {dur / n:>8.2f} {dur / per:>8.1f} {gap / per:>11.1f} {path / per:>12.1f}")


def profile_prefill(engine, prompt_len: int, gen: torch.Generator, top: int = 25) -> None:
    """Kernel time breakdown of a whole prefill (all its chunks) of one prompt."""
    print_kernel_table(engine, lambda: run_ttft(engine, prompt_len, gen), top)


def print_kernel_table(engine, fn, top: int, host: bool = False) -> None:
    """The profiler's table of what fn() ran, by device time (CPU time without a GPU, or with host=True:
    the host's operators by their CPU time, launches included)."""
    on_gpu = engine.backend.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CUDA] if on_gpu and not host else \
        [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn()
    key = "cuda_time_total" if on_gpu and not host else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60))


def run_ttft(engine, prompt_len: int, gen: torch.Generator) -> float:
    from deepinfer.engine.sampling_params import SamplingParams

    prompt = torch.randint(2, engine.config.vocab_size, (prompt_len,), generator=gen).tolist()
    sync(engine.backend.device)
    started = time.perf_counter()
    engine.add_request(f"ttft{prompt_len}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sync(engine.backend.device)
    return time.perf_counter() - started


def transformers_decode(hf, batch: int, context: int, new_tokens: int, gen: torch.Generator) -> float:
    """Decode tokens/s of transformers generate: (time for 1 + new_tokens) - (time for 1), greedy."""
    device = next(hf.parameters()).device
    ids = torch.randint(2, hf.config.vocab_size, (batch, context), generator=gen).to(device)
    mask = torch.ones_like(ids)

    def timed(n):
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync(device)
        return time.perf_counter() - t

    timed(2)  # warm-up
    return batch * new_tokens / (timed(1 + new_tokens) - timed(1))


def fits(engine, batch: int, context: int, gen_tokens: int) -> bool:
    bs = engine.runner.spec.block_size
    return batch * math.ceil((context + gen_tokens) / bs) * bs <= engine.num_cache_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--backend", default="cuda_sm100")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 16384])
    p.add_argument("--ttft", nargs="*", type=int, default=[4096, 32768])
    p.add_argument("--gen", type=int, default=64, help="tokens generated per request in the decode cells")
    p.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens (prefill chunk)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["bf16", "fp8_e4m3", "fp32"])
    p.add_argument("--kv-cache-fraction", type=float, default=0.85)
    p.add_argument("--max-prefill-tokens", type=int, default=600_000,
                   help="skip decode cells whose prompts total more than this (prefill time)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    p.add_argument("--peer-context", type=int, default=1024)
    p.add_argument("--profile", action="store_true", help="kernel breakdown of eager decode steps (batch 1, 32) and of each TTFT prefill")
    p.add_argument("--profile-batches", nargs="+", type=int, default=[1, 32], help="batches of --profile's decode steps")
    p.add_argument("--profile-graph", action="store_true",
                   help="timeline of decode graph replays at --profile-batches: kernel time against launch gaps")
    p.add_argument("--profile-host", action="store_true", help="--profile's decode steps by host time per operator")
    p.add_argument("--profile-steps", action="store_true",
                   help="GPU timeline of whole engine decode steps at --profile-batches (graph, sampling, copies)")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model with the same structure (script test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from deepinfer.registry import load_backend

    device = load_backend(args.backend).device
    on_gpu = device.type == "cuda"
    shape = TINY if args.tiny else V2_LITE
    max_model_len = max(args.contexts + args.ttft) + args.gen + 64
    shape = dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], max_model_len))
    if on_gpu:
        sys.path.insert(0, os.path.dirname(__file__))
        from gpu_timing import ceilings

        bandwidth, _, mm_rate = ceilings()
        print(f"{torch.cuda.get_device_name()}: HBM read {bandwidth:.0f} GB/s, bf16 matmul {mm_rate:.0f} TFLOPS; "
              f"torch {torch.__version__}", flush=True)
    else:
        bandwidth, mm_rate = float("nan"), float("nan")
        print(f"CPU run (no roofline): torch {torch.__version__}")
    results: dict = {"bandwidth_gbs": bandwidth, "matmul_tflops": mm_rate, "cells": []}
    gen = torch.Generator().manual_seed(args.seed)

    started = time.perf_counter()
    hf, cfg = build_transformers(shape, str(device), torch.bfloat16 if on_gpu else torch.float32, args.seed)
    n_params = sum(t.numel() for t in hf.parameters())
    print(f"model: {n_params / 1e9:.2f}B parameters (transformers init {time.perf_counter() - started:.1f} s)", flush=True)

    peer = {}
    if not args.no_peer:
        for b in (1, 32):
            try:
                peer[b] = transformers_decode(hf, b, args.peer_context, 16 if b == 1 else 32, gen)
                print(f"transformers generate, batch {b}, {args.peer_context}-token prompts: {peer[b]:.1f} tok/s", flush=True)
            except torch.cuda.OutOfMemoryError as err:
                print(f"transformers batch {b}: out of memory ({err})")
            torch.cuda.empty_cache() if on_gpu else None
    results["transformers"] = peer

    for precision in args.precision:
        print(f"\n== DeepInfer {args.backend}, {precision} weights ==", flush=True)
        engine = build_engine(hf, cfg, args, None if precision == "bf16" else precision, max_model_len)
        spec = engine.runner.spec
        s = Shape.of(shape, spec.bytes_per_token)
        weight_bytes = 2.0 if precision == "bf16" else 1.0 + 4.0 / (128 * 128)
        print("  " + expert_spread(engine, min(4096, max_model_len - 8), gen), flush=True)
        print(f"  {'batch':>5} {'context':>7} {'prefill s':>9} {'decode tok/s':>12} {'roofline':>9} {'of roof':>7} "
              f"{'vs transformers':>15} {'step ms':>8} {'graph ms':>9}")
        for context in args.contexts:
            for batch in args.batches:
                cell = {"precision": precision, "batch": batch, "context": context}
                if not fits(engine, batch, context, args.gen):
                    need = batch * (context + args.gen) * spec.bytes_per_token * engine.model.num_cache_layers / 2**30
                    print(f"  {batch:>5} {context:>7}  skipped: the latent cache would need {need:.0f} GiB "
                          f"({engine.num_cache_tokens} tokens fit)")
                    cell["skipped"] = f"cache needs {need:.0f} GiB"
                elif batch * context > args.max_prefill_tokens:
                    print(f"  {batch:>5} {context:>7}  skipped: {batch * context} prompt tokens to prefill "
                          f"(> --max-prefill-tokens {args.max_prefill_tokens})")
                    cell["skipped"] = "prefill too long for one run"
                else:
                    prefill_s, tok_s, steps = run_decode(engine, batch, context, args.gen, gen)
                    roof = batch / (s.decode_bytes(batch, context, weight_bytes) / (bandwidth * 1e9))
                    vs = peer.get(batch)
                    vs_text = f"{tok_s / vs:.1f}x" if vs and context == args.peer_context else "-"
                    step_ms = sorted(steps)[len(steps) // 2] * 1e3
                    replay = graph_replay_ms(engine, batch)
                    replay_text = "-" if replay is None else f"{replay:.2f}"
                    print(f"  {batch:>5} {context:>7} {prefill_s:>9.2f} {tok_s:>12.1f} {roof:>9.0f} "
                          f"{tok_s / roof:>7.2f} {vs_text:>15} {step_ms:>8.2f} {replay_text:>9}", flush=True)
                    cell.update(prefill_s=prefill_s, decode_tok_s=tok_s, roofline_tok_s=roof, steps=len(steps),
                                median_step_ms=step_ms, graph_replay_ms=replay)
                results["cells"].append(cell)
        if args.profile_graph:
            for batch in args.profile_batches:
                profile_graph_replay(engine, batch)
        if args.profile_steps:
            for batch in (b for b in args.profile_batches if b <= engine.engine_config.max_num_seqs):
                profile_decode_steps(engine, batch, args.contexts[0], gen)
        if args.profile:
            for batch in (b for b in args.profile_batches if b <= engine.engine_config.max_num_seqs):  # more would queue
                by = "host operators by CPU time" if args.profile_host else "kernels by CUDA time"
                print(f"  eager decode step, batch {batch}, context {args.contexts[0]}: {by}")
                profile_eager_step(engine, batch, args.contexts[0], gen, host=args.profile_host)
        for prompt in args.ttft:
            if prompt + 1 > max_model_len:
                continue
            # First a prompt of a length this engine has not prefilled (kernels that plan per shape, such as
            # cuDNN's attention, pay that here), then another of the same length.
            first, again = run_ttft(engine, prompt, gen), run_ttft(engine, prompt, gen)
            floor = s.prefill_flops(prompt) / (mm_rate * 1e12)
            print(f"  time to first token, {prompt}-token prompt: {first * 1e3:.0f} ms first, {again * 1e3:.0f} ms "
                  f"again; FLOP floor {floor * 1e3:.0f} ms at {mm_rate:.0f} TFLOPS ({first / floor:.2f}x / "
                  f"{again / floor:.2f}x the floor)", flush=True)
            results["cells"].append({"precision": precision, "ttft_prompt": prompt, "ttft_s": first,
                                     "ttft_again_s": again, "floor_s": floor})
            if args.profile:
                print(f"  prefill of a {prompt}-token prompt: kernels by CUDA time")
                profile_prefill(engine, prompt, gen)
        del engine
        if on_gpu:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
