"""An ingress replica's hand-over of one model's requests: each goes to the pool at once, whole (its workers'
schedulers form each forward from what waits at them: workers/pool/scheduler.py), with no waiting for other
requests. The replica limits only what it has handed over and not yet answered (429 beyond) and how long it waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ppo_logprobs.workers.request import ScoreRequest, ScoreResult

from .errors import Overloaded, WorkersTimedOut


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
        self.handed = 0  # requests so far

    async def submit(self, request: ScoreRequest) -> tuple[ScoreResult, int]:
        if self.out >= self.max_queue:
            raise Overloaded(retry_after=1.0)
        tokens = int(request.offsets[-1])
        self.out, self.out_tokens, self.handed = self.out + 1, self.out_tokens + tokens, self.handed + 1
        try:
            result = await asyncio.wait_for(self.score(request), self.timeout_s)
        except asyncio.TimeoutError:
            raise WorkersTimedOut(f"the workers did not answer within {self.timeout_s:.0f} s (a node down, or "
                                  "overloaded)") from None
        finally:
            self.out, self.out_tokens = self.out - 1, self.out_tokens - tokens
        return result, result.steps_waited
