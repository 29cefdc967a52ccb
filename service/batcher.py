"""Per-model scheduling of worker calls at an ingress replica: concurrent requests are joined into calls of up to
`batch_tokens` tokens, and a large request is cut into such calls, which interleave with other requests (the line
is the workers' own, scheduler.Line). A full queue answers 429.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from ppo_logprobs.workers.pool.scheduler import Line
from ppo_logprobs.workers.request import ScoreRequest, ScoreResult

from .errors import Overloaded, WorkersTimedOut


class Batcher:
    """`await submit(request)` -> (ScoreResult of one weights version, calls waited). `score` is the pool's async
    scoring function; at most `max_in_flight` calls run at once."""

    def __init__(self, score: Callable[[ScoreRequest], Awaitable[ScoreResult]], *, batch_tokens: int, wait_s: float,
                 max_queue: int, max_in_flight: int, timeout_s: float = 300.0,
                 min_shared_prefix: int | None = None) -> None:
        self.score = score
        self.line = Line(batch_tokens, min_shared_prefix)
        self.batch_tokens = batch_tokens
        self.wait_s = wait_s
        self.max_queue = max_queue
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.in_flight = 0
        self._wake: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()  # the runner and the calls in flight: kept until done

    @property
    def waiting(self):
        return self.line.waiting

    @property
    def calls(self) -> int:
        return self.line.steps

    @property
    def batched_tokens(self) -> int:
        return self.line.stepped_tokens

    def queued_tokens(self) -> int:
        return self.line.queued_tokens()

    async def submit(self, request: ScoreRequest) -> tuple[ScoreResult, int]:
        if self._wake is None:
            self._wake, self._slots = asyncio.Event(), asyncio.Semaphore(self.max_in_flight)
            self._spawn(self._run())
        if len(self.line) >= self.max_queue:
            raise Overloaded(retry_after=1.0)
        item = self.line.add(request, asyncio.get_running_loop().create_future())
        self._wake.set()
        return await item.future

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()
            while not self.line.waiting:
                self._wake.clear()
                await self._wake.wait()
            deadline = time.monotonic() + self.wait_s
            while self.queued_tokens() < self.batch_tokens and (left := deadline - time.monotonic()) > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = self.line.take()
            if not batch:
                self._slots.release()
                continue
            self._spawn(self._call(batch))

    async def _call(self, batch) -> None:
        self.in_flight += 1
        try:
            joined = ScoreRequest.concat([item.request.span(lo, hi) for item, lo, hi in batch])
            try:
                result = await asyncio.wait_for(self.score(joined), self.timeout_s)
            except asyncio.TimeoutError:
                self.line.fail(batch, WorkersTimedOut(
                    f"the workers did not answer within {self.timeout_s:.0f} s (a node down, or overloaded)"))
            except Exception as e:  # every request of the call gets the failure; none is left waiting
                self.line.fail(batch, e)
            else:
                if self.line.answer(batch, joined, result):
                    self._wake.set()
        finally:
            self.in_flight -= 1
            self._slots.release()
