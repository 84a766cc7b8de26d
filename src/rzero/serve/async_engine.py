"""Drive one Engine from a background thread and hand each request's tokens to asyncio.

Only that thread touches the engine. New requests and aborts reach it through an inbox and are
applied between steps, so the event loop never waits for a forward pass, and every request in
flight is batched into the same steps (continuous batching).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from rzero.engine import Engine, SamplingParams
from rzero.engine.sequence import StepOutput

log = logging.getLogger(__name__)

Deliver = Callable[[StepOutput | BaseException], None]


class RequestStream:
    """The sampled tokens of one request's samples, as (sample index, StepOutput), in order."""

    def __init__(self, sample_ids: list[str], outputs: asyncio.Queue, abort: Callable[[list[str]], None]):
        self.sample_ids = sample_ids
        self._index = {sample_id: i for i, sample_id in enumerate(sample_ids)}
        self._outputs = outputs
        self._abort = abort
        self._unfinished = set(sample_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, StepOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return self._index[item.request_id], item

    def close(self) -> None:
        """Abort the samples still generating (the client went away); harmless once all finished."""
        if self._unfinished:
            self._abort(sorted(self._unfinished))
            self._unfinished.clear()


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._deliver: dict[str, Deliver] = {}  # sample id -> where its tokens go (engine thread only)
        self._thread = threading.Thread(target=self._run, name="rzero-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join()

    async def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue params.n samples of each prompt, all or none: a prompt the engine rejects raises
        its ValueError, and nothing stays queued. Samples are numbered prompt by prompt."""
        loop = asyncio.get_running_loop()
        added: asyncio.Future[list[str]] = loop.create_future()
        outputs: asyncio.Queue = asyncio.Queue()

        def deliver(item: StepOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        def settle(ids: list[str] | None, error: Exception | None) -> None:  # runs on the event loop
            if added.cancelled():  # the caller left while the request was being added
                if ids:
                    self.abort(ids)
            elif error is not None:
                added.set_exception(error)
            else:
                added.set_result(ids)

        def add() -> None:  # runs on the engine thread, between steps
            ids: list[str] = []
            try:
                for i, prompt in enumerate(prompts):
                    ids += self.engine.add_request(prompt, params, f"{request_id}-{i}")
            except Exception as error:  # ValueError for input the engine rejects; the thread must live on
                for sample_id in ids:
                    self.engine.abort(sample_id)
                    self.engine.pop_output(sample_id)
                loop.call_soon_threadsafe(settle, None, error)
                return
            for sample_id in ids:
                self._deliver[sample_id] = deliver
            loop.call_soon_threadsafe(settle, ids, None)

        self._inbox.put(add)
        return RequestStream(await added, outputs, self.abort)

    def abort(self, sample_ids: list[str]) -> None:
        def abort() -> None:
            for sample_id in sample_ids:
                if self._deliver.pop(sample_id, None) is not None:
                    self.engine.abort(sample_id)
                    self.engine.pop_output(sample_id)

        self._inbox.put(abort)

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while True:
            # Block for work only when there is nothing to step.
            jobs = [] if self.engine.has_unfinished() else [self._inbox.get()]
            while not self._inbox.empty():
                jobs.append(self._inbox.get_nowait())
            if None in jobs:
                self._fail_all(RuntimeError("the server is shutting down"))
                return
            for job in jobs:
                job()
            if self.engine.has_unfinished():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            # The same batch would fail again: end every request in flight with the error.
            log.exception("engine step failed")
            self._fail_all(error)
            return
        for out in outputs:
            deliver = self._deliver[out.request_id]
            if out.finished:
                del self._deliver[out.request_id]
                self.engine.pop_output(out.request_id)
            deliver(out)

    def _fail_all(self, error: Exception) -> None:
        for sample_id, deliver in list(self._deliver.items()):
            self.engine.abort(sample_id)
            self.engine.pop_output(sample_id)
            deliver(error)
        self._deliver.clear()
