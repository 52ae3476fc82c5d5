"""ServingEngine: the AsyncLLMEngine as the HTTP handlers use it.

It adds what a server needs around the engine: admission control (503 + Retry-After once the waiting queue
is full, and while draining), one `RequestStream` per engine request that records latency metrics and
always releases its request (abort when the consumer leaves early: a client disconnect frees the cache
blocks), and the SIGTERM drain (refuse new work, let in-flight requests finish, abort the rest after a
timeout).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from deepinfer.engine.async_engine import AsyncLLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.serve.errors import ServerDrainingError, ServerOverloadedError
from deepinfer.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class ServingEngine:
    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics, *, max_queued_requests: int):
        self.engine = engine
        self.metrics = metrics
        llm = engine.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len: int = llm.max_model_len
        self.eos_token_ids: tuple[int, ...] = tuple(llm.config.eos_token_ids)
        self.vocab_size: int = llm.config.vocab_size
        # Requests beyond the running batch that may wait before new ones get 503.
        self.capacity = llm.engine_config.max_num_seqs + max_queued_requests
        self.draining = False
        self._active: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_task: asyncio.Task | None = None

    # ----- state ---------------------------------------------------------------------------------------

    @property
    def active_requests(self) -> int:
        return len(self._active)

    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    def start(self) -> None:
        self.engine.start()

    async def shutdown(self) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
        for request_id in list(self._active):
            await self.engine.abort(request_id)
        if self._active:  # let the engine loop apply the aborts (and free the blocks) before it stops
            try:
                await asyncio.wait_for(self._idle.wait(), 2.0)
            except asyncio.TimeoutError:
                logger.warning("%d request(s) still open at shutdown", len(self._active))
        await self.engine.shutdown()

    # ----- admission -----------------------------------------------------------------------------------

    def check_admission(self, count: int = 1) -> None:
        """Raise 503 if `count` more engine requests cannot be queued now."""
        if self.draining:
            self.metrics.rejected.labels(reason="draining").inc()
            raise ServerDrainingError("the server is shutting down and accepts no new requests")
        if len(self._active) + count > self.capacity:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise ServerOverloadedError(
                f"the server is at capacity ({len(self._active)} requests running or waiting, limit {self.capacity}); "
                "retry later"
            )

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue one engine request. InvalidInputError (a 400) propagates before anything is queued."""
        self.check_admission()
        arrival = time.monotonic()
        self._active.add(request_id)
        self._idle.clear()
        self.metrics.active.set(len(self._active))
        try:
            outputs = await self.engine.add_request(request_id, prompt_ids, params)
        except BaseException:
            self._release(request_id)
            raise
        return RequestStream(self, request_id, outputs, arrival, len(prompt_ids))

    def _release(self, request_id: str) -> None:
        self._active.discard(request_id)
        self.metrics.active.set(len(self._active))
        if not self._active:
            self._idle.set()

    # ----- drain ---------------------------------------------------------------------------------------

    def begin_drain(self, timeout: float) -> None:
        """Stop admitting; abort what is still running after `timeout` seconds. Safe to call twice."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining: %d request(s) in flight, up to %.1f s to finish", len(self._active), timeout)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(timeout), name="deepinfer-drain")

    async def _drain(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            logger.warning("drain timeout: aborting %d request(s)", len(self._active))
            for request_id in list(self._active):
                await self.engine.abort(request_id)

    async def wait_idle(self) -> None:
        await self._idle.wait()


class RequestStream:
    """The outputs of one engine request, with metrics; `close()` aborts it unless it finished."""

    def __init__(self, serving: ServingEngine, request_id: str, outputs: AsyncIterator[RequestOutput],
                 arrival: float, prompt_len: int):
        self.serving = serving
        self.request_id = request_id
        self._outputs = outputs
        self._arrival = arrival
        self._prompt_len = prompt_len
        self._last_token_time: float | None = None
        self.finished = False
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self._outputs:
                self._record(out)
                yield out
                if out.finished:
                    return
        finally:
            await self.close()

    def _record(self, out: RequestOutput) -> None:
        m = self.serving.metrics
        now = time.monotonic()
        steps = max((len(c.delta_token_ids) for c in out.outputs), default=0)
        if steps:
            if self._last_token_time is None:
                m.ttft.observe(now - self._arrival)
                steps -= 1  # the first token's latency is the TTFT
            if steps:
                gap = (now - (self._last_token_time or self._arrival)) / steps
                for _ in range(steps):
                    m.itl.observe(gap)
            self._last_token_time = now
        if out.finished:
            self.finished = True
            m.e2e.observe(now - self._arrival)
            m.request_prompt_tokens.inc(self._prompt_len)
            m.request_generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
            for c in out.outputs:
                m.finished.labels(finish_reason=c.finish_reason or "unknown").inc()

    async def close(self) -> None:
        """Release the request: abort it in the engine if it has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.finished:
                await self.serving.engine.abort(self.request_id)
                self.serving.metrics.finished.labels(finish_reason="abort").inc()
            aclose = getattr(self._outputs, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except RuntimeError:  # still running in a cancelled task: its own finally aborts
                    pass
        finally:
            self.serving._release(self.request_id)
