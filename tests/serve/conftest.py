"""Fixtures for the server tests: a scripted-but-real DeepSeek-V3 checkpoint and real servers on loopback.

The checkpoint is a transformers DeepseekV3ForCausalLM whose layers add nothing to the residual stream
(attention o_proj and every MLP down_proj are zero), so the logits depend only on the current token:
embed_tokens and lm_head are set so that greedy (and, with a wide margin, sampled) next token = a fixed
successor of the current one. The real engine then emits, through real forward passes:

    after `<｜Assistant｜>`:        <think>Checking the weather.</think> + one DeepSeek tool call + eos
    after `<｜tool▁outputs▁end｜>`:  It is sunny in Paris. + eos

Every other token has random embedding and lm_head rows in separate dimensions: from such a token the
model behaves like a random model (and never emits eos), which the completion tests use.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from deepinfer.text.markers import (
    ASSISTANT,
    BOS,
    DEEPSEEK_V3_SPECIAL_TOKENS,
    EOS,
    THINK_END,
    THINK_START,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_OUTPUTS_END,
    TOOL_SEP,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REASONING = "Checking the weather."
TOOL_ARGS = '{"city": "Paris"}'
ANSWER = "It is sunny in Paris."
# Added (non-special) tokens, so each script step is one distinct token: the successor map is a function.
SCRIPT_TEXT_TOKENS = (REASONING, "function", "get_weather\n```json\n", TOOL_ARGS, "\n```", ANSWER)
TOOL_SCRIPT = (THINK_START, REASONING, THINK_END, TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN, "function", TOOL_SEP,
               "get_weather\n```json\n", TOOL_ARGS, "\n```", TOOL_CALL_END, TOOL_CALLS_END, EOS)
ANSWER_SCRIPT = (ANSWER, EOS)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CORPUS = [
    "Hello world, this is a small test of the server.",
    "The weather in Paris is sunny; the temperature is 21 degrees.",
    "你好，世界！天气很好。 emoji: 😀🎉 café",
    '{"city": "Paris", "unit": "celsius", "days": [1, 2, 3]}',
    "def add(a, b):\n    return a + b\n",
]
HIDDEN = 64
MAX_POSITIONS = 512


def write_tokenizer(folder: Path) -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in DEEPSEEK_V3_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, normalized=False) for t in SCRIPT_TEXT_TOKENS])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
              "model_max_length": MAX_POSITIONS, "tokenizer_class": "PreTrainedTokenizerFast"}
    import json

    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return tok


def successor_map(tok: BackendTokenizer) -> dict[int, int]:
    ids = tok.token_to_id
    succ: dict[int, int] = {ids(ASSISTANT): ids(TOOL_SCRIPT[0]), ids(TOOL_OUTPUTS_END): ids(ANSWER_SCRIPT[0])}
    for script in (TOOL_SCRIPT, ANSWER_SCRIPT):
        for a, b in zip(script, script[1:]):
            succ[ids(a)] = ids(b)
    assert len(succ) == len(TOOL_SCRIPT) - 1 + len(ANSWER_SCRIPT) - 1 + 2  # every source token is distinct
    return succ


def build_scripted_checkpoint(folder: Path) -> Path:
    from tiny_checkpoints import build_hf_model

    tok = write_tokenizer(folder)
    vocab = tok.get_vocab_size()
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    model = build_hf_model("deepseek_v3", seed=3, vocab_size=vocab, num_hidden_layers=2,
                           max_position_embeddings=MAX_POSITIONS, bos_token_id=bos, eos_token_id=eos)
    succ = successor_map(tok)
    g = torch.Generator().manual_seed(5)
    k = len(succ)  # scripted dims 0..k-1, random dims k..HIDDEN-1
    assert k < HIDDEN // 2
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()  # each layer adds nothing: logits depend on the current token only
        model.model.norm.weight.fill_(1.0)
        embed = torch.zeros(vocab, HIDDEN)
        head = torch.zeros(vocab, HIDDEN)
        scripted = set(succ)
        for t in range(vocab):
            if t not in scripted:
                embed[t, k:] = torch.randn(HIDDEN - k, generator=g)
        script_targets = set(succ.values()) | scripted | {eos}
        for t in range(vocab):
            if t not in script_targets:  # only "free" tokens come out of random context: eos never does
                head[t, k:] = 0.35 * torch.randn(HIDDEN - k, generator=g)
        for d, (t, nxt) in enumerate(sorted(succ.items())):
            embed[t, d] = 1.0  # after the final RMSNorm: 8.0 in dim d
            head[nxt, d] = 4.0  # logit 32 for the successor, 0 for every other token
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scripted_checkpoint(tmp_path_factory.mktemp("scripted-v3"))


# ----- a real server on a free loopback port, in a background thread ---------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def engine(self):
        """The LLMEngine behind the app (read its stats; never drive it from the test thread)."""
        return self.app.state.serving.engine.engine

    def wait_idle(self, timeout: float = 20.0) -> Any:
        """Engine stats once no request is in flight (the engine thread finishes aborts between steps)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine.stats()
            serving = self.app.state.serving
            if (serving.active_requests == 0 and not self.engine.has_unfinished()
                    and stats.free_blocks == stats.num_blocks):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(checkpoint: Path | None, **options: Any) -> RunningServer:
    """Build the app from the same argument parser the CLI uses, and run uvicorn in a thread.

    checkpoint None: no --model-path, so the embedded default model is served."""
    import uvicorn

    from deepinfer.serve.cli import build_app_from_args, parse_args

    port = free_port()
    options.setdefault("served_model_name", "tiny-v3")
    argv = ([] if checkpoint is None else ["--model-path", str(checkpoint)]) + [
        "--host", "127.0.0.1", "--port", str(port), "--backend", "reference", "--dtype", "float32",
        "--kv-cache-memory", str(16 << 20)]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    args = parse_args(argv)
    app = build_app_from_args(args)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", app, server, thread)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models on 2 shared cores: one intra-op thread is ~100x faster than two fighting other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    """A server per test module: no API key, served as "tiny-v3"."""
    running = start_server(checkpoint)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def make_server(checkpoint: Path) -> Iterator[Callable[..., RunningServer]]:
    """Factory for servers with other options (auth, a small queue); all stopped at the end."""
    started: list[RunningServer] = []

    def make(**options: Any) -> RunningServer:
        running = start_server(checkpoint, **options)
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()
