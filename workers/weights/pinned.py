"""Host-to-device copies through a ring of pinned host buffers, each with a copy stream of its own: checkpoint reads
(file bytes, checkpoint.py) and a sender's host tensors (transfer.copy_from_host) both go through it. A pageable host
tensor copied straight to the device runs at a fraction of the bus's speed, and pinning is slow, so the buffers are
made once per process and reused."""

from __future__ import annotations

import queue
from collections.abc import Callable

import torch
from torch import Tensor

READ_THREADS = 8  # threads filling buffers at once, and buffers in the ring
CHUNK_BYTES = 64 << 20  # one buffer's bytes: the most one copy_through_pinned moves

_slots: queue.Queue | None = None  # (pinned buffer, stream, event of its last copy), shared by all copies


def pinned_slots(device: torch.device) -> queue.Queue:
    """READ_THREADS pinned host buffers with a copy stream each, made once per process (pinning is slow). Called once
    before the threads that copy start (it is not locked)."""
    global _slots
    if _slots is None:
        _slots = queue.Queue()
        for _ in range(READ_THREADS):
            buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
            _slots.put((buffer, torch.cuda.Stream(device), None))
    return _slots


def copy_through_pinned(slots: queue.Queue, nbytes: int, fill: Callable[[Tensor], object],
                        copy: Callable[[Tensor], object]) -> torch.cuda.Event:
    """One chunk to the device through a free buffer of `slots` (blocks while all are taken): once the buffer's last
    copy out has finished, fill(its first nbytes, uint8) on the host, then copy(the same bytes) issued on the
    buffer's stream (a non-blocking copy to the device), and an event recorded there after it. Returns that event:
    the chunk is on the device once it has completed (the buffer is not reused before)."""
    buf, stream, done = slots.get()
    try:
        if done is not None:
            done.synchronize()  # the last copy out of this buffer has finished
        fill(buf[:nbytes])
        with torch.cuda.stream(stream):
            copy(buf[:nbytes])
            done = torch.cuda.Event()
            done.record(stream)
        return done
    finally:
        slots.put((buf, stream, done))
