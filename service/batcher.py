"""Per-model scheduling of worker calls. Concurrent requests are joined into calls of up to `batch_tokens` tokens,
and a large request is cut into such calls, which interleave with other requests: the waiting requests are served
in turn, a request that still has sequences left goes to the back of the line. So a request waits for about one
call before its first part runs, however large the requests ahead of it. A full queue answers 429.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from ppo_logprobs.workers.errors import WeightsChanged
from ppo_logprobs.workers.prefixes import neighbour_groups
from ppo_logprobs.workers.request import VERSION_ATTEMPTS, ScoreRequest, ScoreResult, stale_parts

from .errors import Overloaded, WorkersTimedOut


@dataclass(eq=False)
class _Waiting:
    request: ScoreRequest
    future: asyncio.Future
    queued_at: int  # calls started when it was queued
    todo: deque = field(default_factory=deque)  # (lo, hi) ranges of its sequences not yet sent
    parts: list = field(default_factory=list)  # (lo, hi, ScoreResult) received
    calls_waited: int | None = None  # calls started after it was queued and before its first
    attempts: int = 1
    groups: np.ndarray | None = None  # where each sequence's run of neighbours sharing a prompt begins


class Batcher:
    """`await submit(request)` -> (ScoreResult of one weights version, calls waited). `score` is the pool's async
    scoring function; at most `max_in_flight` calls run at once."""

    def __init__(self, score: Callable[[ScoreRequest], Awaitable[ScoreResult]], *, batch_tokens: int, wait_s: float,
                 max_queue: int, max_in_flight: int, timeout_s: float = 300.0,
                 min_shared_prefix: int | None = None) -> None:
        self.score = score
        self.min_shared_prefix = min_shared_prefix  # the workers': a cut falls between groups of a shared prompt
        self.batch_tokens = batch_tokens
        self.wait_s = wait_s
        self.max_queue = max_queue
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.waiting: deque[_Waiting] = deque()
        self.calls = 0  # started so far
        self.batched_tokens = 0
        self.in_flight = 0
        self._wake: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()  # the runner and the calls in flight: kept until done

    async def submit(self, request: ScoreRequest) -> tuple[ScoreResult, int]:
        if self._wake is None:
            self._wake, self._slots = asyncio.Event(), asyncio.Semaphore(self.max_in_flight)
            self._spawn(self._run())
        if len(self.waiting) >= self.max_queue:
            raise Overloaded(retry_after=1.0)
        item = _Waiting(request, asyncio.get_running_loop().create_future(), self.calls,
                        groups=neighbour_groups(request, self.min_shared_prefix))
        item.todo.append((0, len(request)))
        self.waiting.append(item)
        self._wake.set()
        return await item.future

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def queued_tokens(self) -> int:
        return sum(int(w.request.offsets[hi] - w.request.offsets[lo]) for w in self.waiting for lo, hi in w.todo)

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()
            while not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            deadline = time.monotonic() + self.wait_s
            while self.queued_tokens() < self.batch_tokens and (left := deadline - time.monotonic()) > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = self._take()
            if not batch:
                self._slots.release()
                continue
            self.calls += 1
            self._spawn(self._call(batch))

    def _take(self) -> list[tuple[_Waiting, int, int]]:
        """Up to batch_tokens tokens from the waiting requests in turn (at least one sequence), all asking for one
        top_k (a tail's mass depends on its k); the others keep their places at the head of the line."""
        batch, room, skipped = [], self.batch_tokens, []
        for _ in range(len(self.waiting)):
            if room <= 0:
                break
            item = self.waiting.popleft()
            if item.future.done():  # its client went away
                continue
            if batch and item.request.top_k != batch[0][0].request.top_k:
                skipped.append(item)
                continue
            offsets = item.request.offsets
            while item.todo and room > 0:
                lo, hi = item.todo[0]
                end = int(np.searchsorted(offsets, offsets[lo] + room, side="right")) - 1
                end = min(hi, max(end, lo + 1 if not batch else lo))
                inside = end < hi and lo < item.groups[end] < end  # the cut would split a group begun in this span
                if inside:
                    end = int(item.groups[end])  # (the group goes whole in a later call)
                if end == lo:
                    break
                batch.append((item, lo, end))
                if item.calls_waited is None:
                    item.calls_waited = self.calls - item.queued_at
                room -= int(offsets[end] - offsets[lo])
                item.todo[0] = (end, hi)
                if end == hi:
                    item.todo.popleft()
                if inside:
                    break
            if item.todo:
                self.waiting.append(item)  # to the back of the line
        self.waiting.extendleft(reversed(skipped))
        return batch

    async def _call(self, batch: list[tuple[_Waiting, int, int]]) -> None:
        self.in_flight += 1
        try:
            joined = ScoreRequest.concat([item.request.span(lo, hi) for item, lo, hi in batch])
            try:
                result = await asyncio.wait_for(self.score(joined), self.timeout_s)
            except asyncio.TimeoutError:
                error: BaseException = WorkersTimedOut(
                    f"the workers did not answer within {self.timeout_s:.0f} s (a node down, or overloaded)"
                )
            except Exception as e:  # every request of the call gets the failure; none is left waiting
                error = e
            else:
                self.batched_tokens += int(joined.offsets[-1])
                start = 0
                for item, lo, hi in batch:
                    item.parts.append((lo, hi, result.span(start, start + hi - lo).fit(item.request)))
                    start += hi - lo
                    self._finish(item)
                return
            for item, _, _ in batch:
                if not item.future.done():
                    item.future.set_exception(error)
                if item in self.waiting:
                    self.waiting.remove(item)
        finally:
            self.in_flight -= 1
            self._slots.release()

    def _finish(self, item: _Waiting) -> None:
        """Completes a request whose parts are all in, all of one version; parts answered with older weights than
        its newest part are queued again."""
        if item.future.done() or sum(hi - lo for lo, hi, _ in item.parts) < len(item.request):
            return
        late = stale_parts([r.weights_version for _, _, r in item.parts])
        if not late:
            parts = [(np.arange(lo, hi), r) for lo, hi, r in item.parts]
            item.future.set_result((ScoreResult.merge(parts, len(item.request), item.request.return_entropy),
                                    item.calls_waited or 0))
            return
        if item.attempts > VERSION_ATTEMPTS:  # (asked again VERSION_ATTEMPTS times, as the pool and the client do)
            item.future.set_exception(WeightsChanged(f"the weights changed during the request {VERSION_ATTEMPTS} "
                                                     "times; retry"))
            return
        item.attempts += 1
        item.todo.extend(item.parts[i][:2] for i in late)
        stale = set(late)
        item.parts = [p for i, p in enumerate(item.parts) if i not in stale]
        self.waiting.append(item)
        self._wake.set()
