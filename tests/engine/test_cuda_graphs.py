"""Decode graphs: padded replays equal eager forwards, padding touches only the sink block, and on a GPU the
engine's graphed greedy tokens equal the reference backend's.

Without a GPU, cuda_sm100 runs its kernels under the Triton interpreter and a "replay" re-runs the forward on
the graph's persistent buffers: the padding and in-place re-planning are what is tested there.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.attention import AttentionBatch, KVCacheSpec
from deepinfer.engine.cuda_graphs import default_batch_sizes
from deepinfer.engine.runner import ModelRunner
from deepinfer.errors import ConfigError
from deepinfer.model.loader import load_model
from deepinfer.registry import list_backends, load_backend

from tiny_checkpoints import build_hf_model, save_checkpoint

GPU = torch.cuda.is_available()
CUDA_USABLE = any(b.name == "cuda_sm100" and b.usable for b in list_backends())
BLOCK = 16


def test_default_batch_sizes():
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = default_batch_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and all(b % 16 == 0 for b in sizes[4:])
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))  # padding wastes at most 15 rows


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_hf_model("deepseek_v3", seed=5, gain=0.5, max_position_embeddings=256)
    return save_checkpoint(hf, tmp_path_factory.mktemp("graph-model"))


def test_backend_without_graphs_is_refused(checkpoint):
    backend = load_backend("reference")
    model = load_model(checkpoint, backend, dtype=torch.float32, progress=False)
    spec = KVCacheSpec(8, BLOCK, model.config.kv_lora_rank, model.config.qk_rope_head_dim, "fp32")
    with pytest.raises(ConfigError, match="graph"):
        ModelRunner(model, backend, spec, graph_batch_sizes=(1, 2))


@pytest.mark.skipif(not CUDA_USABLE, reason="cuda_sm100 is not usable here")
def test_padded_replay_matches_eager_and_writes_only_the_sink(checkpoint, gen):
    # Batch-invariant kernels: a row's result cannot depend on the padding rows beside it or on the KV split,
    # so replays must equal eager forwards bit for bit (else a near-tied expert of the random router may flip).
    backend = load_backend("cuda_sm100", batch_invariant=True)
    model = load_model(checkpoint, backend, dtype=torch.float32, progress=False)
    config = model.config
    num_blocks, max_len = 12, 64
    spec = KVCacheSpec(num_blocks, BLOCK, config.kv_lora_rank, config.qk_rope_head_dim, "bf16")
    graphed = ModelRunner(model, backend, spec, graph_batch_sizes=(1, 4), max_seq_len=max_len)
    eager = ModelRunner(model, backend, spec)
    assert graphed.spec.num_blocks == num_blocks + 1 and graphed.num_usable_blocks == num_blocks
    sink = num_blocks
    for cache in graphed.kv_caches:
        cache[:num_blocks].zero_()  # capture's dummy rows may only ever touch the sink block

    # Three sequences on scattered blocks; blocks 9-11 stay unused.
    tables = ((3, 0, 7), (5, 1), (2, 8, 4, 6))
    prompt_lens = (20, 9, 33)
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    prefill = AttentionBatch(prompt_lens, prompt_lens, tables)
    ids = [t for p in prompts for t in p]
    rows = [sum(prompt_lens[: i + 1]) - 1 for i in range(3)]
    for runner in (graphed, eager):
        out = runner.execute(prefill, ids, rows)
        assert not out.graphed
    lens = list(prompt_lens)
    for step in range(4):
        live = 3 if step < 3 else 1  # 3 sequences pad to 4; then one sequence runs on the size-1 graph
        lens = [n + 1 for n in lens]
        batch = AttentionBatch((1,) * live, tuple(lens[:live]), tables[:live])
        tokens = torch.randint(2, config.vocab_size, (live,), generator=gen).tolist()
        got = graphed.execute(batch, tokens, list(range(live)))
        want = eager.execute(batch, tokens, list(range(live)))
        assert got.graphed and not want.graphed and got.logits.shape == want.logits.shape
        assert torch.equal(got.logits, want.logits)
    for cache in graphed.kv_caches:
        assert not cache[9:num_blocks].any(), "padding rows wrote outside the sink block"
        assert cache[sink].any()
    # Not a decode step (two queries for one sequence): eager.
    batch = AttentionBatch((2,), (lens[0] + 2,), tables[:1])
    assert not graphed.execute(batch, [5, 6], [0, 1]).graphed
    # An idle expert-parallel rank replays a graph on dummy rows alone: nothing outside the sink changes.
    before = [cache[:num_blocks].clone() for cache in graphed.kv_caches]
    for size in (4, 1):
        graphed.graphs.run_idle(size)
    assert all(torch.equal(cache[:num_blocks], b) for cache, b in zip(graphed.kv_caches, before, strict=True))
    # Released graphs (before an expert-parallel group is torn down): decode steps run eagerly again.
    graphed.graphs.release()
    batch = AttentionBatch((1,), (lens[0] + 1,), tables[:1])
    assert not graphed.execute(batch, [5], [0]).graphed


def test_runner_follows_the_expert_parallel_agreement(checkpoint, gen):
    """Under expert parallelism the runner asks `agree` (tokens, graph-served?) once per forward and replays the
    graph of the agreed capacity's size, padding its own batch up to it, only when every rank is graph-served;
    else it runs eagerly with that capacity. A fake agreement stands in for the other ranks here."""
    backend = load_backend("cuda_sm100", batch_invariant=True)
    model = load_model(checkpoint, backend, dtype=torch.float32, progress=False)
    config = model.config
    spec = KVCacheSpec(8, BLOCK, config.kv_lora_rank, config.qk_rope_head_dim, "bf16")
    runner = ModelRunner(model, backend, spec, graph_batch_sizes=(1, 4), max_seq_len=64, expert_parallel=True)
    eager = ModelRunner(model, backend, spec)
    prompt = torch.randint(2, config.vocab_size, (9,), generator=gen).tolist()
    prefill = AttentionBatch((9,), (9,), ((2, 5),))
    asked = []
    others = {"capacity": 9, "graphed": False}  # another rank's step, as the fake agreement reports it

    def agree(tokens: int, graphed: bool) -> tuple[int, bool]:
        asked.append((tokens, graphed))
        return max(tokens, others["capacity"]), graphed and others["graphed"]

    runner.agree = agree
    for r in (runner, eager):
        r.execute(prefill, prompt, [8])
    assert asked == [(9, False)]
    decode = AttentionBatch((1,), (10,), ((2, 5),))
    for capacity, graphed, size in ((3, True, 4), (3, False, None), (1, True, 1), (7, True, None)):
        others.update(capacity=capacity, graphed=graphed)
        token = int(torch.randint(2, config.vocab_size, (), generator=gen))
        got = runner.execute(decode, [token], [0])
        want = eager.execute(decode, [token], [0])
        assert asked[-1] == (1, True) and got.graphed == (size is not None), (capacity, graphed)
        if size is not None:  # padded to the agreed size: the token sits in that graph's input buffer
            assert int(runner.graphs._graphs[size].input_ids[0]) == token
        if backend.device.type == "cpu":
            assert torch.equal(got.logits, want.logits)
        else:  # the agreed capacity gives the MoE a fixed-capacity layout: other grouped-GEMM tiles than eager's
            torch.testing.assert_close(got.logits, want.logits, rtol=2e-3, atol=2e-3)


@pytest.fixture(scope="module")
def margin_checkpoint(tmp_path_factory):
    """A random model with spread-out weights (tiny_checkpoints' gain): greedy choices have real margins."""
    hf = build_hf_model("deepseek_v3", seed=int(torch.randint(0, 1000, ())), gain=1.5, max_position_embeddings=256)
    return str(save_checkpoint(hf, tmp_path_factory.mktemp("margin-model")))


def _prompts(gen: torch.Generator, count: int) -> list[list[int]]:
    return [torch.randint(2, 96, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (count,), generator=gen)]


@pytest.mark.skipif(not (GPU and CUDA_USABLE), reason="needs a GPU for cuda_sm100 with CUDA graphs")
def test_graphs_and_overlap_change_speed_not_tokens(margin_checkpoint, gen):
    """Batch-invariant kernels: the graphed, overlapped engine and the eager, synchronous one generate the
    same tokens bit for bit (padding rows and pending tokens leave every real row untouched)."""
    common = dict(dtype=torch.bfloat16, kv_cache_dtype="bf16", progress=False, block_size=16, batch_invariant=True)
    fast = LLM(margin_checkpoint, backend="cuda_sm100", cuda_graph_max_batch_size=16, **common)
    assert fast.engine.runner.graphs is not None and fast.engine.engine_config.overlap_scheduling
    slow = LLM(margin_checkpoint, backend="cuda_sm100", enforce_eager=True, overlap_scheduling=False, **common)
    prompts = _prompts(gen, 12)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in slow.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    assert got == want


def _teacher_forced(cpu: LLM, prompts: list[list[int]], outs) -> list[tuple[int, float]]:
    """(rank, log-prob gap to the best token) under the reference of each token the engine generated."""
    forced = cpu.generate([p + o.outputs[0].token_ids for p, o in zip(prompts, outs)],
                          SamplingParams(max_tokens=1, prompt_logprobs=1, ignore_eos=True))
    scored = []
    for p, out, ref in zip(prompts, outs, forced):
        for i, token in enumerate(out.outputs[0].token_ids):
            lps = ref.prompt_logprobs[len(p) + i]
            scored.append((lps[token].rank, max(lp.logprob for lp in lps.values()) - lps[token].logprob))
    return scored


@pytest.mark.skipif(not (GPU and CUDA_USABLE), reason="needs a GPU for cuda_sm100 with CUDA graphs")
def test_graphed_engine_generates_the_reference_tokens(tmp_path, gen):
    """The GPU path changes speed, not answers: on a small dense float32 model (bf16 latent cache on both
    sides; the GPU's attention then runs in float32 too) the graphed, overlapped engine's greedy continuations
    are the reference backend's, token for token. The only licence is summation order: two lists may part
    where the reference itself has a near-tie (its best two tokens within 1e-3 nats), never elsewhere."""
    hf = build_hf_model("deepseek_v3", seed=int(torch.randint(0, 1000, (), generator=gen)), gain=1.5,
                        max_position_embeddings=256, first_k_dense_replace=3)
    path = str(save_checkpoint(hf, tmp_path / "dense"))
    common = dict(dtype=torch.float32, kv_cache_dtype="bf16", progress=False, block_size=16)
    gpu = LLM(path, backend="cuda_sm100", cuda_graph_max_batch_size=16, **common)
    assert gpu.engine.runner.graphs is not None
    cpu = LLM(path, backend="reference", **common)
    prompts = _prompts(gen, 16)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    parted = [(p, g, w) for p, g, w in zip(prompts, got, want) if g != w]
    for p, g, w in parted:
        i = next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)
        lps = cpu.generate([p + w[:i]], SamplingParams(max_tokens=1, logprobs=2, temperature=0.0))[0].outputs[0].logprobs[0]
        assert g[i] in lps and lps[w[i]].logprob - lps[g[i]].logprob < 1e-3, (i, lps)
    assert len(parted) <= 2, f"{len(parted)} of {len(prompts)} continuations part at near-ties"


@pytest.mark.skipif(not (GPU and CUDA_USABLE), reason="needs a GPU for cuda_sm100 with CUDA graphs")
def test_graphed_moe_engine_follows_the_reference(margin_checkpoint, gen):
    """With a random MoE router that rounding now and then also flips a near-tied expert, which moves that
    one position's logits by up to a few nats (the same happens on the CPU under the Triton interpreter,
    without graphs). Teacher-forced against the reference, nearly every token is still its greedy choice."""
    common = dict(dtype=torch.float32, kv_cache_dtype="bf16", progress=False, block_size=16)
    gpu = LLM(margin_checkpoint, backend="cuda_sm100", cuda_graph_max_batch_size=16, **common)
    cpu = LLM(margin_checkpoint, backend="reference", **common)
    prompts = _prompts(gen, 12)
    outs = gpu.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    ranks = [rank for rank, _ in _teacher_forced(cpu, prompts, outs)]
    assert sum(r == 1 for r in ranks) >= 0.95 * len(ranks), ranks


@pytest.mark.skipif(not (GPU and CUDA_USABLE), reason="host synchronisation only exists with a GPU")
@pytest.mark.parametrize("precision", [None, "fp8"])
def test_an_eager_step_never_waits_for_the_device(checkpoint, gen, precision):
    """Planning and a whole eager forward (prefill and decode) queue work without reading anything back."""
    backend = load_backend("cuda_sm100")
    model = load_model(checkpoint, backend, dtype=torch.bfloat16, precision=precision, progress=False)
    config = model.config
    spec = KVCacheSpec(12, BLOCK, config.kv_lora_rank, config.qk_rope_head_dim, "bf16")
    runner = ModelRunner(model, backend, spec)
    batches = [AttentionBatch((20, 9), (20, 9), ((3, 0), (5,))), AttentionBatch((1, 1), (21, 10), ((3, 0), (5,)))]
    for batch in batches * 2:  # the first round compiles the kernels
        ids = torch.randint(2, config.vocab_size, (batch.num_tokens,), generator=gen).tolist()
        rows = list(range(batch.num_tokens))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner.execute(batch, ids, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
