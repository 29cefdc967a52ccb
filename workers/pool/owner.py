"""WeightOwner: the one owner of a pool's weights. A small async Ray actor per pool that every handle of the pool
(the gateway's, each trainer's `connect_pool`) goes through to change weights, so that

- versions are unique and increasing (one counter, kept in Ray's GCS key-value store, so a restarted owner goes on
  counting where it stopped),
- updates are serialised (one lock) and all-or-none: every worker stages the new weights first; only when all have
  them does the owner tell them to commit, otherwise they drop them and nothing changes,
- a worker that Ray restarted gets the current weights back: from the current checkpoint when it still exists,
  else streamed from a live peer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import ray
from ray.exceptions import RayActorError

from ..errors import BadWeights, UpdateFailed, WeightsUnavailable, cause, clip, non_finite
from . import kv
from .kv import NAMESPACE

log = logging.getLogger(__name__)

STAGING = "staging"  # the workers' concurrency group (a thread) in which updates are read or received, so that
# a worker goes on scoring with the weights it has meanwhile; commits run between scoring calls
HEALTH = "health"  # and the one in which it answers health checks, beside scoring and staging
SCORING = "scoring"  # and the callers' scoring calls, each waiting in the worker's line (scheduler.py) for its turn
SCORING_CALLS = 4096  # (callers waiting at once, on one event loop; more wait in Ray's queue, and the line's limits
# refuse beyond)
READ_DEADLINE_S = 900.0  # the longest a worker may take to read a checkpoint before the update is given up


def staging(worker, method: str):
    """`worker.method`, run in the worker's staging thread (beside scoring)."""
    return getattr(worker, method).options(concurrency_group=STAGING)


def actors(names: list[str]) -> list:
    """Handles to actors named in NAMESPACE, looked up now (ValueError for one that is gone)."""
    return [ray.get_actor(n, namespace=NAMESPACE) for n in names]


def _update_error(error: BaseException) -> BaseException:
    error = cause(error)
    if isinstance(error, RayActorError):
        return UpdateFailed(f"a worker died during the update ({type(error).__name__}); nothing changed")
    return error


class WeightOwner:
    def __init__(self, key: str, model: str) -> None:
        self.key = key
        saved = kv.get(key)
        state = json.loads(saved) if saved else {"version": 0, "source": {"path": model}}
        self.version: int = state["version"]  # the version every worker serves once its commit landed
        self.source: dict = state["source"]  # {"path": checkpoint} or {"stream": True}
        self.config: dict | None = state.get("config")  # to rebuild a worker whose checkpoint is gone
        self.names: list[str] | None = state.get("names")  # the workers' actor names, for a named pool
        self.workers: list = []
        if self.names:  # this owner was restarted: a named pool's workers are found by name
            try:
                self.workers = actors(self.names)
            except ValueError:
                log.error("the pool's workers %s are gone", self.names)
        self.lock = asyncio.Lock()
        self.streams: dict[int, asyncio.Task] = {}

    def _save(self) -> None:
        state = json.dumps({"version": self.version, "source": self.source,
                            "config": self.config, "names": self.names}, default=str)
        kv.put(self.key, state)

    def forget(self) -> None:
        kv.delete(self.key)

    def set_workers(self, workers: list, config: dict, names: list[str] | None = None) -> None:
        self.workers, self.config, self.names = list(workers), config, names
        self._save()

    def _pool(self) -> list:
        if not self.workers:
            raise WeightsUnavailable("the pool's owner was restarted and cannot find its (unnamed) workers; "
                                     "create the pool again")
        return self.workers

    def state(self) -> dict:
        return {"version": self.version, "source": self.source, "workers": self.workers}

    def restore_spec(self) -> dict:
        """For a restarted worker's constructor: where the current weights are."""
        return {"version": self.version, "config": self.config, **self.source}

    def kept(self, version: int, path: str) -> None:
        """A worker's local copy of `version` is whole (pools of one worker keep one)."""
        if version == self.version:
            self.source = {**self.source, "keep": path}
            self._save()

    async def _land(self, staged: list, version: int, source: dict) -> int:
        """Waits for every worker's staging call (each returns the name of a staged tensor that is not finite, when
        asked to check); commits everywhere if all succeeded and every staged tensor checked is finite, else aborts
        everywhere and raises the first failure (a BadWeights before any other)."""
        outcomes = await asyncio.gather(*staged, return_exceptions=True)
        errors = [_update_error(e) for e in outcomes if isinstance(e, BaseException)]
        errors += [non_finite(name) for name in outcomes if isinstance(name, str)][:1]
        if errors:
            await asyncio.gather(*(w.abort.remote(version) for w in self.workers), return_exceptions=True)
            raise next((e for e in errors if isinstance(e, BadWeights)), errors[0])
        self.version, self.source = version, source
        self._save()
        commits = await asyncio.gather(*(w.commit.remote(version) for w in self.workers), return_exceptions=True)
        for i, outcome in enumerate(commits):
            if isinstance(outcome, BaseException):  # it died after staging: restored when it comes back
                log.warning("worker %d did not commit version %d: %s", i, version, cause(outcome))
        return version

    async def update_from_path(self, path: str, allow_non_finite: bool = False) -> int:
        async with self.lock:
            version = self.version + 1  # updates are serialised: the next one, unless this one fails
            return await self._land([self._read(w, path, version, not allow_non_finite) for w in self._pool()],
                                    version, {"path": path})

    @staticmethod
    async def _read(worker, path: str, version: int, check: bool = False) -> str | None:
        try:
            return await asyncio.wait_for(staging(worker, "stage_checkpoint").remote(path, version, check),
                                          READ_DEADLINE_S)
        except TimeoutError:  # (asyncio.wait_for raises the builtin since Python 3.11, the declared minimum)
            raise UpdateFailed(f"a worker did not finish reading the checkpoint {clip(path, 200)!r} within "
                               f"{READ_DEADLINE_S:.0f} s (a hung file system?); nothing changed") from None

    async def open_group(self, spec) -> None:
        """Every worker joins a sender's group (ranks 1..n, in worker order; a tensor-parallel worker's ranks
        one after another, each receiving the whole tensors and keeping its parts)."""
        ranks = (spec.world_size - 1) // len(self._pool())
        await asyncio.gather(*(staging(w, "join_group").remote(spec, 1 + i * ranks)
                               for i, w in enumerate(self.workers)))

    async def close_group(self, name: str) -> None:
        await asyncio.gather(*(w.leave_group.remote(name) for w in self.workers), return_exceptions=True)

    async def begin_stream(self, group: str, shapes: dict, bucket_bytes: int, full: bool = False,
                           allow_non_finite: bool = False):
        """Checks the update on every worker, starts their receiving, and returns (version, staging layout) for
        the sender to broadcast. The update lock is held until the stream has landed or failed."""
        await self.lock.acquire()
        try:
            # (every worker checks its own state; the first lays the update out: one layout)
            layouts = await asyncio.gather(*(w.layout_for.remote(shapes, full, group, i == 0)
                                             for i, w in enumerate(self._pool())))
        except Exception as e:
            self.lock.release()
            raise cause(e) from None
        version = self.version + 1
        staged = [staging(w, "stage_stream").remote(group, layouts[0], version, bucket_bytes, not allow_non_finite)
                  for w in self.workers]

        async def land() -> int:
            try:
                return await self._land(staged, version, {"stream": True})
            finally:
                self.lock.release()

        self.streams[version] = asyncio.create_task(land())
        return version, layouts[0]

    async def plan(self, shapes: dict, full: bool = False):
        """The staging layout of an update with these names and shapes (IncompatibleWeights when it does not fit)."""
        try:
            return await self._pool()[0].layout_for.remote(shapes, full)
        except Exception as e:
            raise cause(e) from None

    async def update_shared(self, key: str, shared: list | None, layout, allow_non_finite: bool = False) -> int:
        """An update from a sender on the workers' own GPU: the tensors it shared by CUDA IPC under `key` (`shared`,
        their handles, when it shares them anew; None: the ones the workers hold, read again)."""
        async with self.lock:
            version = self.version + 1
            return await self._land([staging(w, "stage_shared").remote(key, shared, layout, version,
                                                                       not allow_non_finite)
                                     for w in self._pool()], version, {"stream": True})

    async def release_shared(self, key: str) -> None:
        """Every worker lets go of the tensors shared under `key` (the sender closes)."""
        await asyncio.gather(*(w.release_shared.remote(key) for w in self.workers), return_exceptions=True)

    async def devices(self) -> list[str]:
        """Each worker's GPU (its UUID), or its device when it has none; every rank's for tensor-parallel workers."""
        return [d for ds in await asyncio.gather(*(w.devices.remote() for w in self._pool())) for d in ds]

    async def finish_stream(self, version: int) -> int:
        return await self.streams.pop(version)

    async def restore(self, index: int) -> int:
        """Brings worker `index` to the current version if it is behind: from a live peer at that version over the
        workers' collective backend, else from the current checkpoint."""
        async with self.lock:
            worker, version = self._pool()[index], self.version
            info = await worker.info.remote()
            if info["weights_version"] == version:
                return version
            peers = []
            for i, w in enumerate(self.workers):
                if i != index:
                    try:
                        peer_info = await asyncio.wait_for(w.info.remote(), 30)
                    except Exception:  # dead or hung: not a peer to restore from; the others may be
                        log.info("worker %d did not answer; not restoring worker %d from it", i, index, exc_info=True)
                        continue
                    if peer_info["weights_version"] == version:
                        peers.append(w)
            try:
                if peers:
                    await self._stream_from_peer(peers[0], worker, info["device"], version)
                elif "path" in self.source or "keep" in self.source:
                    await self._stage_from_disk(worker, version)
                else:
                    raise WeightsUnavailable(
                        f"a restarted worker needs weights version {version}, which were streamed, and no live worker "
                        "holds them: send the weights again"
                    )
            except WeightsUnavailable:
                raise
            except Exception as e:  # the caller retries later (a 503); the log keeps what went wrong
                log.warning("restoring worker %d to version %d failed", index, version, exc_info=True)
                raise WeightsUnavailable(f"restoring a restarted worker failed: {cause(e)}") from None
            return await worker.commit.remote(version)

    async def _stage_from_disk(self, worker, version: int) -> None:
        """The current checkpoint, or the worker's local copy when the checkpoint is gone."""
        try:
            await self._read(worker, self.source.get("path") or self.source["keep"], version)
        except Exception:
            if "keep" not in self.source or "path" not in self.source:
                raise
            log.info("the checkpoint of version %d cannot be read; restoring from the local copy", version,
                     exc_info=True)
            await self._read(worker, self.source["keep"], version)

    async def _stream_from_peer(self, peer, worker, device: str, version: int) -> None:
        """The peer sends all its parameters to the worker in a group of two (one per rank, rank r to rank r, for
        tensor-parallel workers: both hold the same parts)."""
        from ..weights.transfer import BUCKET_BYTES  # (here: the pool's handles alone import no torch)

        name = f"restore-{uuid.uuid4().hex[:12]}"
        spec = await peer.open_sender.remote(name, 2, "nccl" if device.startswith("cuda") else "gloo", 300.0)
        joined = staging(worker, "join_group").remote(spec, 1)
        sent = staging(peer, "send_weights").remote(spec)
        try:
            await joined
            await asyncio.gather(staging(worker, "stage_stream").remote(name, None, version, BUCKET_BYTES), sent)
        finally:
            worker.leave_group.remote(name)
