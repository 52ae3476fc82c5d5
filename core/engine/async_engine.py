"""AsyncLLMEngine: the engine behind an asyncio server.

A background task owns the LLMEngine: it applies queued adds and aborts between steps and runs each step
in a worker thread, so the event loop keeps serving while the model runs and the engine's state is only
ever touched by one step at a time. `add_request` returns an async iterator of the request's outputs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import DeepInferError

logger = logging.getLogger(__name__)

FAILURE_CHECK_S = 1.0


class EngineError(DeepInferError, RuntimeError):
    """The engine could not serve a request."""


class EngineDeadError(EngineError):
    """The engine loop failed; no request can make progress."""


class RequestFailedError(EngineError):
    """The engine failed this request (its step ran out of device memory) and goes on serving the others."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: list[tuple] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None

    @property
    def is_healthy(self) -> bool:
        """False once the step loop has failed (every request then fails with EngineDeadError)."""
        return self._dead is None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="deepinfer-engine")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request; raises InvalidInputError (before any output) for a bad one."""
        self._check_alive()
        self.start()
        queue: asyncio.Queue = asyncio.Queue()
        done = asyncio.get_running_loop().create_future()
        self._commands.append(("add", request_id, prompt, params, queue, done))
        self._wake.set()
        await done  # re-raises the engine's validation error
        return self._stream(request_id, queue)

    async def abort(self, request_id: str) -> None:
        self._commands.append(("abort", request_id))
        self._wake.set()

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await queue.get()
                if isinstance(item, RequestFailedError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item}") from item
                yield item
                if item.finished:
                    return
        finally:
            if request_id in self._streams:  # the consumer went away early (client disconnect): free the request
                await self.abort(request_id)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for command in commands:
            if command[0] == "add":
                _, request_id, prompt, params, queue, done = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as exc:  # validation: the caller gets it, the engine goes on
                    done.set_exception(exc)
                    continue
                self._streams[request_id] = queue
                done.set_result(None)
            else:
                final = self.engine.abort(command[1])
                queue = self._streams.pop(command[1], None)
                if queue is not None and final is not None:
                    queue.put_nowait(final)

    async def _step(self) -> list[RequestOutput]:
        """engine.step() in a worker thread. While it runs, the engine's failure() is checked every
        FAILURE_CHECK_S: a step blocked on a peer process that is gone (an expert-parallel rank) would
        otherwise hold every request until the collective timeout; the blocked thread is left behind."""
        step = asyncio.ensure_future(asyncio.to_thread(self.engine.step))
        while True:
            done, _ = await asyncio.wait({step}, timeout=FAILURE_CHECK_S)
            if done:
                return step.result()
            failure = self.engine.failure()
            if failure is not None:
                raise EngineDeadError(failure)

    async def _run(self) -> None:
        try:
            while True:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    if not self._commands:
                        await self._wake.wait()
                    continue
                outputs = await self._step()
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out if out.error is None else RequestFailedError(out.error))
                        if out.finished or out.error is not None:
                            self._streams.pop(out.request_id, None)
                await asyncio.sleep(0)  # let handlers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in a step: fail every stream loudly instead of hanging
            logger.exception("engine loop failed")
            self._dead = exc
            for queue in self._streams.values():
                queue.put_nowait(exc)
            self._streams.clear()
