"""Coalesces concurrent requests for one model into worker calls, with a bounded queue."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import ray


class WorkersTimedOut(RuntimeError):
    """A pool call outlived request_timeout_s."""


class Overloaded(Exception):
    """The model's queue is full; the client should retry after `retry_after` seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"overloaded: retry after {retry_after:.0f} s")
        self.retry_after = retry_after


@dataclass
class _Item:
    input_ids: list[list[int]]
    score_from: list[int]
    temperature: list[float]
    return_entropy: bool
    future: asyncio.Future
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = sum(len(s) for s in self.input_ids)


class Batcher:
    """submit() queues a validated request; a background task gathers queued requests up to `batch_tokens` or
    `wait_s`, sends them to the pool as one call, and hands each request its own slice of the results."""

    def __init__(self, pool, *, batch_tokens: int, wait_s: float, max_queue: int, max_in_flight: int,
                 timeout_s: float = 300.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.batch_tokens = batch_tokens
        self.wait_s = wait_s
        self.max_in_flight = max_in_flight
        self.queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=max_queue)
        self.in_flight = 0
        self.batches = 0
        self.batched_tokens = 0
        self._runner: asyncio.Task | None = None
        self._slots: asyncio.Semaphore | None = None

    async def submit(self, input_ids, score_from, temperature, return_entropy: bool):
        if self._runner is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
            self._runner = asyncio.create_task(self._run())
        item = _Item(input_ids, score_from, temperature, return_entropy, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            raise Overloaded(retry_after=1.0) from None
        return await item.future

    async def _run(self) -> None:
        carry: _Item | None = None
        while True:
            first = carry or await self.queue.get()
            carry = None
            batch, tokens = [first], first.tokens
            deadline = time.monotonic() + self.wait_s
            while tokens < self.batch_tokens:
                remaining = deadline - time.monotonic()
                try:
                    item = self.queue.get_nowait() if remaining <= 0 else await asyncio.wait_for(
                        self.queue.get(), remaining
                    )
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                if tokens + item.tokens > self.batch_tokens:
                    carry = item  # starts the next batch
                    break
                batch.append(item)
                tokens += item.tokens
            await self._slots.acquire()
            asyncio.create_task(self._call(batch, tokens))

    async def _call(self, batch: list[_Item], tokens: int) -> None:
        self.in_flight += 1
        try:
            ids = [s for item in batch for s in item.input_ids]
            starts = [s for item in batch for s in item.score_from]
            temps = [t for item in batch for t in item.temperature]
            entropy = any(item.return_entropy for item in batch)
            try:
                ref = self.pool.compute_log_probs_async(ids, starts, temps, entropy)
                try:
                    results = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
                except asyncio.TimeoutError:
                    ray.cancel(ref, force=True)
                    raise WorkersTimedOut(
                        f"the workers did not answer within {self.timeout_s:.0f} s (a node down, or overloaded)"
                    ) from None
            except Exception as e:  # every request of the batch gets the failure, none is left waiting
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
                return
            self.batches += 1
            self.batched_tokens += tokens
            start = 0
            for item in batch:
                n = len(item.input_ids)
                if not item.future.done():  # a client that went away has a cancelled future
                    item.future.set_result(results[start : start + n])
                start += n
        finally:
            self.in_flight -= 1
            self._slots.release()
