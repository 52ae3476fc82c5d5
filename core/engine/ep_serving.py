"""Serving under expert parallelism: rank 0 runs the HTTP server over a front that looks like an LLMEngine;
the other ranks follow.

Each step the front broadcasts (gloo CPU group) the commands queued since the last step: new requests with
the rank chosen to run them (the one with the fewest unfinished requests: data-parallel attention) and
aborts. Every rank applies its share, takes one lockstep step (deepinfer.engine.expert_parallel), and the
front gathers the ranks' outputs and stats. While the server is idle no step runs and the followers wait
in the broadcast (their CPU group has a long timeout for that).

Local launch (`deepinfer-serve --expert-parallel-size N`) spawns ranks 1..N-1 on this host; under torchrun
every process runs the same command and only rank 0 starts the HTTP server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.config import EngineConfig
from deepinfer.engine.expert_parallel import (
    ExpertParallelEngine,
    ParallelContext,
    RankFailedError,
    build_engine,
    check_config,
    dist_backend_for,
    init_distributed,
    launched_by_torchrun,
    shutdown_distributed,
)
from deepinfer.engine.heap import freeze_startup_heap
from deepinfer.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import ConfigError, DeepInferError, InvalidInputError

logger = logging.getLogger(__name__)

_SHUTDOWN = "shutdown"
FOLLOWER_WAIT_S = 7 * 24 * 3600.0  # a follower of an idle server waits this long for the next step
COLLECTIVE_TIMEOUT_S = 1800.0


class ExpertParallelFront:
    """Rank 0's view of all ranks' engines, with the LLMEngine members the async engine and server use."""

    def __init__(self, ep: ExpertParallelEngine, local_ranks: list[Any] | None = None):
        """local_ranks: the follower processes this process spawned (none under torchrun)."""
        self.ep = ep
        self._local_ranks = local_ranks or []
        self._failed: str | None = None
        engine = ep.engine
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.max_model_len = engine.max_model_len
        self.engine_config = engine.engine_config
        self._owner: dict[str, tuple[int, int]] = {}  # unfinished request -> (rank, completions)
        self._last: dict[str, RequestOutput] = {}  # latest output of each unfinished remote request
        self._commands: list[tuple] = []
        self._stats: list[EngineStats] = [engine.stats()] * ep.ctx.world_size

    @property
    def world_size(self) -> int:
        return self.ep.ctx.world_size

    def _pick_rank(self) -> int:
        return least_loaded_rank(self._owner.values(), self.world_size)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Validate on rank 0's engine (every rank has the same configuration) and queue for the chosen rank."""
        if request_id in self._owner:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        self.engine.add_request(request_id, prompt, params)  # raises for a bad request: nothing is queued
        rank = self._pick_rank()
        if rank != 0:
            self.engine.abort(request_id)  # validated only; it runs on `rank`
            self._commands.append(("add", rank, request_id, prompt, params))
        self._owner[request_id] = (rank, params.n)

    def abort(self, request_id: str) -> RequestOutput | None:
        owner = self._owner.pop(request_id, None)
        if owner is None:
            return None
        rank, n = owner
        if rank == 0:
            return self.engine.abort(request_id)
        self._commands.append(("abort", rank, request_id))
        last = self._last.pop(request_id, None)
        done = [CompletionOutput(index=c.index, token_ids=list(c.token_ids), text=c.text, logprobs=c.logprobs,
                                 finish_reason=c.finish_reason or "abort", stop_reason=c.stop_reason)
                for c in (last.outputs if last else [CompletionOutput(index=i) for i in range(n)])]
        return RequestOutput(request_id, last.prompt if last else None, list(last.prompt_token_ids) if last else [],
                             last.prompt_logprobs if last else None, done, True)

    def has_unfinished(self) -> bool:
        return bool(self._owner or self._commands)

    def failure(self) -> str | None:
        """Why the group can no longer step: this rank's step failed, or a local follower process is gone (its
        peers' GPU collectives would wait for it until the collective timeout); None while it can."""
        if self._failed is None:
            for rank, child in enumerate(self._local_ranks, start=1):
                if child.exitcode is not None:
                    self._failed = f"expert-parallel rank {rank} exited (code {child.exitcode})"
                    break
        return self._failed

    def step(self) -> list[RequestOutput]:
        if (failed := self.failure()) is not None:
            raise RankFailedError(failed)
        commands, self._commands = self._commands, []
        try:
            _broadcast(commands, self.ep.ctx)
            outputs = self.ep.step() or []
            gathered: list[Any] = [None] * self.world_size
            dist.gather_object((outputs, self.engine.stats()), gathered, dst=0, group=self.ep.ctx.cpu_group)
        except Exception as exc:
            # The followers wait in collectives this rank will not join: end the local ones now (torchrun's
            # agent ends its own once a process exits).
            for child in self._local_ranks:  # a follower that died is the cause: let its exit code show
                child.join(1.0)
            lost = self.failure()
            self._failed = lost or str(exc)
            for child in self._local_ranks:
                child.kill()
            if lost is None and isinstance(exc, RankFailedError):  # this rank's own step failed: it says how
                raise
            raise RankFailedError(self._failed) from exc
        merged = []
        self._stats = [stats for _, stats in gathered]
        for rank, (outs, _) in enumerate(gathered):
            for out in outs:
                if out.request_id not in self._owner:
                    continue  # aborted here while it was still running there
                merged.append(out)
                if out.finished:
                    self._owner.pop(out.request_id, None)
                    self._last.pop(out.request_id, None)
                elif rank != 0:
                    self._last[out.request_id] = out
        return merged

    def stats(self) -> EngineStats:
        """All ranks' counters summed (as of the last step)."""
        s = self._stats
        hits, queries = sum(x.prefix_cache_hits for x in s), sum(x.prefix_cache_queries for x in s)
        blocks = sum(x.num_blocks for x in s)
        summed = {f.name: sum(getattr(x, f.name) for x in s) for f in dataclasses.fields(EngineStats)
                  if f.type in ("int", int)}
        return dataclasses.replace(s[0], **summed, prefix_cache_hit_rate=hits / queries if queries else 0.0,
                                   cache_usage=sum(x.cache_usage * x.num_blocks for x in s) / blocks if blocks else 0.0)

    def shutdown(self) -> None:
        """Release the followers and leave the process group (not after a failure: collectives left half-way
        would block both)."""
        if self.failure() is not None:
            return
        _broadcast(_SHUTDOWN, self.ep.ctx)
        self._local_ranks = []  # released: their exits are no failure
        self.ep.close()
        shutdown_distributed(self.ep.ctx)


def least_loaded_rank(owners: Iterable[tuple[int, int]], world_size: int) -> int:
    """The rank with the fewest unfinished sequences, from (rank, completions) per unfinished request; ties go to
    the lowest rank. Sequences, not requests: a request with n completions decodes n rows every step, and in
    lockstep the rank with the largest batch sets every rank's step time."""
    load = [0] * world_size
    for rank, completions in owners:
        load[rank] += completions
    return min(range(world_size), key=lambda r: (load[r], r))


def _broadcast(message: Any, ctx: ParallelContext) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=ctx.cpu_group)
    return box[0]


def follow(ep: ExpertParallelEngine) -> None:
    """A follower rank's loop: apply rank 0's commands, step in lockstep, report; until rank 0 says stop.

    Ctrl-C and SIGTERM reach the whole process group; rank 0 drains its server and then releases the
    followers, so they ignore both (a dead rank 0 still ends them: its connections close). The follower serves
    this one engine for its life: its start-up heap is frozen first, as deepinfer-serve does in rank 0's process.
    """
    freeze_startup_heap()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    ctx = ep.ctx
    try:
        while True:
            commands = _broadcast(None, ctx)
            if commands == _SHUTDOWN:
                break
            for command in commands:
                if command[1] != ctx.rank:
                    continue
                try:
                    if command[0] == "add":
                        ep.engine.add_request(*command[2:])
                    else:
                        ep.engine.abort(command[2])
                except DeepInferError as err:  # rank 0 validated it with the same configuration: should not happen
                    logger.error("rank %d could not apply %s %s: %s", ctx.rank, command[0], command[2], err)
            outputs = ep.step() or []
            dist.gather_object((outputs, ep.engine.stats()), None, dst=0, group=ctx.cpu_group)
    except BaseException:
        # This rank's step failed, or rank 0 is gone. Exit at once: a clean teardown would wait in collectives
        # that cannot complete, and an exit closes this rank's connections, so its peers fail fast (rank 0's
        # front reports it; torchrun's agent ends the rest).
        logger.exception("expert-parallel rank %d failed; exiting", ctx.rank)
        logging.shutdown()
        os._exit(1)
    ep.close()
    shutdown_distributed(ctx)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _follower_entry(rank: int, world: int, init_method: str, engine_config: EngineConfig, dist_backend: str) -> None:
    ctx = init_distributed(dist_backend, rank=rank, world_size=world, init_method=init_method,
                           timeout_s=COLLECTIVE_TIMEOUT_S, cpu_timeout_s=FOLLOWER_WAIT_S)
    ep = build_engine(engine_config, ctx)
    dist.barrier(group=ctx.cpu_group)  # pairs with rank 0's in launch()
    follow(ep)


@dataclasses.dataclass
class Launch:
    """This process's part: rank 0 gets the front (and the local followers to join at exit); other ranks
    (torchrun) get front None and have already followed until shutdown."""

    front: ExpertParallelFront | None
    children: list[Any]

    def close(self, timeout_s: float = 60.0) -> None:
        if self.front is not None:
            try:
                self.front.shutdown()
            except Exception as exc:  # a follower already gone: nothing left to release
                logger.warning("expert-parallel shutdown: %s", exc)
        for child in self.children:
            child.join(timeout_s)
            if child.is_alive():
                child.kill()


def launch(engine_config: EngineConfig) -> Launch:
    """Start expert parallelism for serving: spawn the local ranks (or join torchrun's), build this rank's
    engine, and wait until every rank has built its own (a rank that failed closes its connections, so
    the others fail here instead of serving half a model)."""
    world = engine_config.expert_parallel_size
    check_config(engine_config)  # before any process starts
    dist_backend = dist_backend_for(engine_config)
    children: list[Any] = []
    try:
        if launched_by_torchrun():
            ctx = init_distributed(dist_backend, timeout_s=COLLECTIVE_TIMEOUT_S, cpu_timeout_s=FOLLOWER_WAIT_S)
            if ctx.world_size != world:
                raise ConfigError(f"--expert-parallel-size {world} but torchrun started {ctx.world_size} processes")
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            spawn = mp.get_context("spawn")
            for rank in range(1, world):
                # Daemons: they end with this process whatever happens to it.
                child = spawn.Process(target=_follower_entry, args=(rank, world, init_method, engine_config, dist_backend),
                                      name=f"deepinfer-ep-rank{rank}", daemon=True)
                child.start()
                children.append(child)
            ctx = init_distributed(dist_backend, rank=0, world_size=world, init_method=init_method,
                                   timeout_s=COLLECTIVE_TIMEOUT_S, cpu_timeout_s=FOLLOWER_WAIT_S)
        ep = build_engine(engine_config, ctx)
        dist.barrier(group=ctx.cpu_group)
    except BaseException:
        for child in children:
            child.kill()
        raise
    if ctx.rank != 0:
        follow(ep)
        return Launch(None, children)
    return Launch(ExpertParallelFront(ep, children), children)
