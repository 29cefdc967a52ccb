"""An ingress replica's hand-over of one model's requests to the pool (its workers' schedulers form each forward
from what waits at them: workers/pool/scheduler.py). A small request goes out as one pool call with whatever other
small requests reach the hand-over by the event loop's next turn, or, while earlier calls are out, within 1 ms: on
an idle service it waits for nothing, and under load one Ray call carries many requests. Each call costs CPU on
both sides (about 0.8 ms in the replica on a CI core), so that is most of their CPU a request saved. A joined call
that fails is sent again one request at a time, so an error reaches only the request it belongs to. The replica
limits only what it has handed over and not yet answered (429 beyond) and how long it waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ppo_logprobs.workers.request import ScoreRequest, ScoreResult

from .errors import Overloaded, WorkersTimedOut

JOIN_TOKENS = 16384  # a request this large or larger goes alone; joined calls stay under it
JOIN_WAIT_S = 0.001  # while calls are out, the most a request waits for others to join it


class Handover:
    """`await submit(request)` -> (ScoreResult of one weights version, the steps it waited at its workers). `score`
    is the pool's async scoring function; at most `max_queue` requests are out at once."""

    def __init__(self, score: Callable[[ScoreRequest], Awaitable[ScoreResult]], *, max_queue: int,
                 timeout_s: float = 300.0) -> None:
        self.score = score
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.out = 0  # requests handed over and not answered
        self.out_tokens = 0
        self.calls = 0  # pool calls so far (a joined call counts once)
        self.waiting: dict[int, list[tuple[ScoreRequest, asyncio.Future]]] = {}  # by top_k: not sent yet
        self.sending: set[asyncio.Task] = set()  # (the loop keeps only weak references to tasks)

    async def submit(self, request: ScoreRequest) -> tuple[ScoreResult, int]:
        if self.out >= self.max_queue:
            raise Overloaded(retry_after=1.0)
        tokens = int(request.offsets[-1])
        self.out, self.out_tokens = self.out + 1, self.out_tokens + tokens
        try:
            if tokens >= JOIN_TOKENS:
                return await self._call(request)
            future = asyncio.get_running_loop().create_future()
            group = self.waiting.setdefault(request.top_k, [])
            if not group:  # (idle: at the loop's next turn; busy: within JOIN_WAIT_S, for the requests close behind)
                asyncio.get_running_loop().call_later(JOIN_WAIT_S if self.sending else 0, self._send, request.top_k)
            group.append((request, future))
            return await future
        finally:
            self.out, self.out_tokens = self.out - 1, self.out_tokens - tokens

    async def _call(self, request: ScoreRequest) -> tuple[ScoreResult, int]:
        self.calls += 1
        try:
            result = await asyncio.wait_for(self.score(request), self.timeout_s)
        except TimeoutError:
            raise WorkersTimedOut(f"the workers did not answer within {self.timeout_s:.0f} s (a node down, or "
                                  "overloaded)") from None
        return result, result.steps_waited

    def _send(self, top_k: int) -> None:
        """The requests waiting with this top_k, in calls of under JOIN_TOKENS tokens."""
        group, call, size = self.waiting.pop(top_k), [], 0
        for request, future in group:
            if call and size + int(request.offsets[-1]) > JOIN_TOKENS:
                self._start(call)
                call, size = [], 0
            call.append((request, future))
            size += int(request.offsets[-1])
        self._start(call)

    def _start(self, call: list[tuple[ScoreRequest, asyncio.Future]]) -> None:
        task = asyncio.ensure_future(self._joined(call))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _joined(self, call: list[tuple[ScoreRequest, asyncio.Future]]) -> None:
        try:
            if len(call) == 1:
                await self._answer(*call[0])
                return
            try:
                result, waited = await self._call(ScoreRequest.concat([r for r, _ in call]))
            except (Overloaded, WorkersTimedOut) as e:  # (one at a time would fare no better)
                for _, future in call:
                    if not future.done():
                        future.set_exception(e)
                return
            except Exception:  # each alone, so that whatever failed reaches only its own request
                await asyncio.gather(*(self._answer(r, f) for r, f in call))
                return
            at = 0
            for request, future in call:
                if not future.done():
                    future.set_result((result.span(at, at + len(request)).fit(request), waited))
                at += len(request)
        finally:  # (whatever happened above, no request is left waiting)
            for _, future in call:
                if not future.done():
                    future.set_exception(RuntimeError("the hand-over's call ended without an answer"))

    async def _answer(self, request: ScoreRequest, future: asyncio.Future) -> None:
        try:
            answer = await self._call(request)
        except Exception as e:
            if not future.done():
                future.set_exception(e)
        else:
            if not future.done():
                future.set_result(answer)
