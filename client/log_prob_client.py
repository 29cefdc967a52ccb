"""HTTP clients of the gateway (sync and async), and connect_pool for trainers on the same Ray cluster.

Both clients split a batch under the server's per-request token limit and join the results in order, all of one
weights version (parts answered with older weights than another part are asked again). Scoring and reads are retried
on transport errors (a dropped connection, a timeout), on 429 and 503 answers, and on a 5xx or 404 that Serve's proxy
gave instead of the gateway (no X-Replica header: the ingress replica was lost, or a proxy that restarted knows no
route yet), after their Retry-After or an exponential backoff, with random jitter so that many clients do not retry in
step; a reload (not idempotent), a 4xx, the gateway's own 500 and what no retry can change (a URL that is not http(s),
a request that cannot be sent) are never retried. Anything that is not retried raises LogProbError with the server's
message. Results come as float32 bytes (`binary=True`, the default; see workers/wire.py) or as JSON text.

All of that is one core without I/O (`_Core`, whose methods are generators of Steps), shared by both clients; each
client only runs the steps with its own I/O: httpx.Client and time.sleep, or httpx.AsyncClient and asyncio.sleep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, TypeVar, Unpack

import httpx
import numpy as np

from ppo_logprobs.workers.errors import WeightsChanged
from ppo_logprobs.workers.outputs import OUTPUTS
from ppo_logprobs.workers.prefixes import MIN_SHARED_PREFIX as SHARED_PREFIX  # (the server's default)
from ppo_logprobs.workers.request import Parts, ScoringOptions, SequenceScores
from ppo_logprobs.workers.wire import BINARY, ModelInfo, decode_binary

RETRY_STATUSES = (429, 503)
# transport errors no retry can change: a URL that is not http(s) or not a URL, a request that cannot be sent as made
UNFIXABLE = (httpx.UnsupportedProtocol, httpx.LocalProtocolError, httpx.InvalidURL)
Outcome = httpx.Response | httpx.TransportError | httpx.InvalidURL  # what one attempt of a call gives
log = logging.getLogger("ppo_logprobs.client")


class LogProbError(RuntimeError):
    """The server refused or failed a request; `status` and `detail` are what it said (status 0: no answer)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


SequenceLogProbs = SequenceScores  # (the client's name for it: one per-sequence result type everywhere)


def _chunks(input_ids: Sequence[Sequence[int]], limit: int | None) -> list[range]:
    """Index ranges of consecutive sequences, each under `limit` tokens (a longer sequence goes alone). A part ends
    before a group of neighbours that share their first SHARED_PREFIX tokens (a GRPO group) rather than inside it,
    unless the group began before the part did: the server computes a group's prefix once per request."""
    out, start, tokens, group = [], 0, 0, 0
    for i, seq in enumerate(input_ids):
        if i and list(input_ids[i - 1][:SHARED_PREFIX]) != list(seq[:SHARED_PREFIX]) or len(seq) < SHARED_PREFIX:
            group = i  # (a new group, or none)
        if limit is not None and tokens and tokens + len(seq) > limit:
            cut = group if group > start else i
            out.append(range(start, cut))
            start, tokens = cut, sum(len(s) for s in input_ids[cut:i])
        tokens += len(seq)
    out.append(range(start, len(input_ids)))
    return out


def _per_sequence(value, n: int) -> list:
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value] * n


def _bodies(input_ids, score_from, model, limit, *, rollout_log_probs=None, temperature=1.0, return_entropy=True,
            top_k=0, token_ids=None) -> dict[range, dict]:
    """The request bodies of one call, by the run of its sequences each holds."""
    n = len(input_ids)
    starts, temps = _per_sequence(score_from, n), _per_sequence(temperature, n)
    if len(starts) != n or len(temps) != n:
        raise ValueError(f"score_from and temperature need one value or {n} (one per sequence)")
    per_sequence = token_ids is not None and len(token_ids) > 0 and isinstance(token_ids[0], (Sequence, np.ndarray))
    if per_sequence and len(token_ids) != n:
        raise ValueError(f"token_ids has {len(token_ids)} lists for {n} sequences (or give one list for all)")
    if rollout_log_probs is not None and len(rollout_log_probs) != n:
        raise ValueError(f"rollout_log_probs has {len(rollout_log_probs)} lists for {n} sequences")
    bodies = {}
    for part in _chunks(input_ids, limit):
        body = {
            "input_ids": [list(map(int, input_ids[i])) for i in part],
            "score_from": [int(starts[i]) for i in part],
            "temperature": [float(temps[i]) for i in part],
            "return_entropy": return_entropy,
        }
        if model is not None:
            body["model"] = model
        if top_k:
            body["top_k"] = int(top_k)
        if token_ids is not None:
            body["token_ids"] = ([list(map(int, token_ids[i])) for i in part] if per_sequence
                                 else list(map(int, token_ids)))
        if rollout_log_probs is not None:
            body["rollout_log_probs"] = [list(map(float, rollout_log_probs[i])) for i in part]
        bodies[part] = body
    return bodies


def _results(responses: list[dict]) -> list[SequenceLogProbs]:
    out = []
    for resp in responses:
        if "offsets" in resp:  # a BINARY answer
            cuts = resp["offsets"][1:-1]
            lp = np.split(resp["log_probs"], cuts)
            ent = np.split(resp["entropy"], cuts) if resp["entropy"] is not None else [None] * len(lp)
            arrays = dict(resp.get("arrays", {}))
            counts = arrays.pop("candidate_counts", None)
            extras = {name: np.split(values, cuts) for name, values in arrays.items()}
            if counts is not None:  # (the wide outputs of token_ids, each sequence's cut to its own list)
                for name in extras:
                    if OUTPUTS[name].per_candidate:
                        extras[name] = [c[:, :k] for c, k in zip(extras[name], counts, strict=True)]
            stats = resp.get("mismatch")
            out.extend(SequenceLogProbs(a, b, resp["weights_version"], extras={k: v[i] for k, v in extras.items()},
                                        mismatch={k: v[i] for k, v in stats.items()} if stats else None)
                       for i, (a, b) in enumerate(zip(lp, ent, strict=True)))
            continue
        for r in resp["results"]:
            entropy = r.get("entropy")
            out.append(SequenceLogProbs(
                log_probs=np.asarray(r["log_probs"], dtype=np.float32),
                entropy=np.asarray(entropy, dtype=np.float32) if entropy is not None else None,
                weights_version=resp["weights_version"], mismatch=r.get("mismatch"),
                extras={name: output.from_json(r[name]) for name, output in OUTPUTS.items() if r.get(name) is not None},
            ))
    return out


def _text(response: httpx.Response) -> str:
    if response.status_code != 200:
        _raise_for(response)
    return response.text


def _raise_for(response: httpx.Response) -> dict:
    if response.status_code == 200:
        if response.headers.get("content-type", "").startswith(BINARY):
            header, log_probs, entropy, offsets = decode_binary(response.content)
            return {**header, "log_probs": log_probs, "entropy": entropy, "offsets": offsets}
        return response.json()
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    raise LogProbError(response.status_code, str(detail))


@dataclass(frozen=True)
class _Send:
    """A step of the core: send this request (the client answers with its Outcome)."""

    method: str
    path: str
    body: dict | None = None


T = TypeVar("T")
# A client's work without its I/O, a generator that the client runs (`_run`): each step it yields is a _Send, answered
# with its Outcome; seconds to wait (a float), answered with None; or a list of Steps, answered with their results in
# order (one after another, or concurrently where the client can).
Steps = Generator["_Send | float | list[Steps]", Any, T]


def _resume(steps: Steps[T], reply) -> tuple[bool, Any]:
    """(False, the next step) of `steps` given the reply to its last one, or (True, its result) when it is done."""
    try:
        return False, steps.send(reply)
    except StopIteration as done:
        return True, done.value


class _Core:
    """What both clients do, without I/O: requests built, batches split under the server's limit, answers read, the
    retry decided, parts answered with older weights asked again (Parts), results assembled. Each client only sends,
    waits and runs steps side by side in its own way (`_run`); `_HTTP` is its httpx class."""

    _HTTP: type[httpx.Client] | type[httpx.AsyncClient]

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None, timeout: float = 600,
                 max_retries: int = 8, backoff: float = 0.5, max_request_tokens: int | None = None,
                 binary: bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        try:
            httpx.URL(self.base_url)
        except httpx.InvalidURL as e:
            raise ValueError(f"{base_url!r:.200} is not a URL ({e}): give the service's, e.g. http://127.0.0.1:8000") \
                from None
        if api_key and not (api_key.isascii() and api_key.isprintable()):  # (nor would a header carry it)
            raise ValueError("the API key holds a line break or a character that is not printable ASCII: is its file "
                             "more than the key?")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if binary:  # results as float32 bytes (bitwise, ~2.5x smaller than JSON text); errors stay JSON
            self.headers["Accept"] = f"{BINARY}, application/json"
        self.timeout, self.max_retries, self.backoff = timeout, max_retries, backoff
        self.max_request_tokens = max_request_tokens
        self._limits: dict[str | None, int] = {}
        self._reached = False  # whether anything has answered at base_url yet
        self.retries = 0  # calls retried so far (transport errors, 429, 503)
        self._http = self._HTTP(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def _call(self, method: str, path: str, body: dict | None = None, *, retry: bool = True) -> Steps[dict]:
        """One call, sent again while `_settle` says so; the body of its answer."""
        for attempt in range(self.max_retries + 1):
            answer, wait = self._settle((yield _Send(method, path, body)), attempt, retry)
            if answer is not None:
                return answer
            self.retries += 1
            yield wait
        raise AssertionError("unreachable")

    def _settle(self, outcome: Outcome, attempt: int, retry: bool) -> tuple[dict | None, float]:
        """(the body, 0) of a final outcome, raising LogProbError for an error; or (None, seconds to wait) when the
        call is to be retried (said on stderr, through logging): Retry-After when the server gave one, else backoff *
        2^attempt, plus up to 25% jitter. A refused connection before anything ever answered is final: nothing
        listens there (after, it is a service restarting, and retried); UNFIXABLE errors are final too."""
        if isinstance(outcome, httpx.ConnectError) and not self._reached:
            raise LogProbError(0, f"nothing listens at {self.base_url} ({outcome}): is the service running?") \
                from outcome
        if isinstance(outcome, UNFIXABLE):
            raise LogProbError(0, f"no request can be sent to {self.base_url} ({type(outcome).__name__}: {outcome})") \
                from outcome
        self._reached |= isinstance(outcome, httpx.Response)
        transient = isinstance(outcome, httpx.TransportError) or outcome.status_code in RETRY_STATUSES or (
            (outcome.status_code >= 500 or outcome.status_code == 404)  # Serve's proxy lost the replica, or has no
            and "x-replica" not in outcome.headers)  # route yet: the gateway itself always names its replica
        if not (retry and transient and attempt < self.max_retries):
            if isinstance(outcome, httpx.TransportError):
                raise LogProbError(0, f"no answer from {self.base_url} ({type(outcome).__name__}: {outcome})") \
                    from outcome
            return _raise_for(outcome), 0.0
        try:
            wait = max(0.0, float(outcome.headers["Retry-After"]))  # type: ignore[union-attr]
        except (AttributeError, KeyError, ValueError):
            wait = self.backoff * 2**attempt
        wait *= 1 + 0.25 * random.random()
        reason = (f"{type(outcome).__name__}: {outcome}" if isinstance(outcome, httpx.TransportError)
                  else f"HTTP {outcome.status_code}")
        log.warning("%s: %s; retry %d of %d in %.1f s", self.base_url, reason, attempt + 1, self.max_retries, wait)
        return None, wait

    def _models(self) -> Steps[list[ModelInfo]]:
        return [ModelInfo(**m) for m in (yield from self._call("GET", "/v1/models"))["data"]]

    def _score(self, input_ids, score_from, model: str | None, **options) -> Steps[list[SequenceLogProbs]]:
        """score's work: the server's limit (asked once per model), the parts sent side by side, those answered with
        older weights than another part asked again, the results in order. `options`: _bodies'."""
        if unknown := sorted(options.keys() - ScoringOptions.__optional_keys__ - {"rollout_log_probs"}):
            raise TypeError(f"score() got an unexpected keyword argument {unknown[0]!r}; its options are model, "
                            f"rollout_log_probs, {', '.join(sorted(ScoringOptions.__optional_keys__))}")
        if model not in self._limits:
            self._limits[model] = self._limit_from((yield from self._models()), model)
        bodies = _bodies(input_ids, score_from, model, self._limits[model], **options)
        parts = Parts(len(input_ids), version=itemgetter("weights_version"))
        ask = list(bodies)
        while ask:
            answers = yield [self._call("POST", "/logprobs", bodies[run]) for run in ask]
            for run, answer in zip(ask, answers, strict=True):
                parts.add(run, answer)
            try:
                ask = parts.again()
            except WeightsChanged as e:
                raise LogProbError(503, str(e)) from None
        return _results(parts.in_order())

    def _limit_from(self, models: list[ModelInfo], model: str | None) -> int:
        info = next((m for m in models if m.name == model), models[0]) if models else None
        return self.max_request_tokens or (info.max_request_tokens if info else 0) or 1 << 62

    def _reload(self, model: str, path: str, allow_non_finite: bool) -> Steps[ModelInfo]:
        body = {"path": path, "allow_non_finite": allow_non_finite}
        return ModelInfo(**(yield from self._call("POST", f"/v1/models/{model}/reload", body, retry=False)))

    def _up(self, path: str) -> Steps[bool]:
        """Whether GET `path` answers 200, asked once; False also when nothing answers."""
        outcome = yield _Send("GET", path)
        if isinstance(outcome, httpx.InvalidURL):
            raise outcome
        return not isinstance(outcome, httpx.TransportError) and outcome.status_code == 200

    def _metrics(self) -> Steps[str]:
        outcome = yield _Send("GET", "/metrics")
        if isinstance(outcome, httpx.TransportError):
            raise LogProbError(0, f"no answer from {self.base_url} ({outcome})") from outcome
        if isinstance(outcome, httpx.InvalidURL):
            raise outcome
        return _text(outcome)


class LogProbClient(_Core):
    """Synchronous client: `LogProbClient("http://127.0.0.1:8000").score([[1, 2, 3]])`."""

    _HTTP = httpx.Client
    _http: httpx.Client

    def _run(self, steps: Steps[T]) -> T:
        """The core's steps with blocking I/O: the requests of a list one after another."""
        done, step = _resume(steps, None)
        while not done:
            done, step = _resume(steps, self._do(step))
        return step

    def _do(self, step: _Send | float | list[Steps]):
        if isinstance(step, _Send):
            try:
                return self._http.request(step.method, step.path, json=step.body)
            except (httpx.TransportError, httpx.InvalidURL) as e:
                return e
        if isinstance(step, list):
            return [self._run(steps) for steps in step]
        time.sleep(step)

    def models(self) -> list[ModelInfo]:
        return self._run(self._models())

    def score(self, input_ids: Sequence[Sequence[int]], score_from: int | Sequence[int] = 1, *,
              model: str | None = None, rollout_log_probs: Sequence[Sequence[float]] | None = None,
              **options: Unpack[ScoringOptions]) -> list[SequenceLogProbs]:
        """One SequenceLogProbs per sequence, in order (split into several requests when needed), all computed with
        one weights_version: parts answered with older weights than another part are asked again. `options`:
        temperature, return_entropy, top_k (each entry's k most likely tokens too: [entries, k] arrays, and the
        tail's log-probability), token_ids (candidates, one list for all sequences or one per sequence, whose
        log-probs each entry gives), as request.ScoringOptions;
        `rollout_log_probs`: the rollout engine's log-probs of the entries (one list per sequence), and each result's
        `mismatch` says how far they are from ours."""
        return self._run(self._score(input_ids, score_from, model, rollout_log_probs=rollout_log_probs, **options))

    def reload(self, model: str, path: str, *, allow_non_finite: bool = False) -> ModelInfo:
        """Loads the checkpoint at `path` (readable by the workers) into `model`; returns its new info. Weights
        holding NaN or infinite values are refused (LogProbError, status 409) unless `allow_non_finite`."""
        return self._run(self._reload(model, path, allow_non_finite))

    def ready(self) -> bool:
        """Every model can score (GET /readyz); False also when nothing answers."""
        return self._run(self._up("/readyz"))

    def alive(self) -> bool:
        """The gateway answers (GET /healthz)."""
        return self._run(self._up("/healthz"))

    def metrics(self) -> str:
        """The Prometheus exposition text (GET /metrics)."""
        return self._run(self._metrics())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> LogProbClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncLogProbClient(_Core):
    """Asynchronous client; the split requests of one call are sent concurrently."""

    _HTTP = httpx.AsyncClient
    _http: httpx.AsyncClient

    async def _run(self, steps: Steps[T]) -> T:
        """The core's steps on this event loop: the requests of a list concurrently."""
        done, step = _resume(steps, None)
        while not done:
            done, step = _resume(steps, await self._do(step))
        return step

    async def _do(self, step: _Send | float | list[Steps]):
        if isinstance(step, _Send):
            try:
                return await self._http.request(step.method, step.path, json=step.body)
            except (httpx.TransportError, httpx.InvalidURL) as e:
                return e
        if isinstance(step, list):
            return await asyncio.gather(*map(self._run, step))
        await asyncio.sleep(step)

    async def models(self) -> list[ModelInfo]:
        return await self._run(self._models())

    async def score(self, input_ids: Sequence[Sequence[int]], score_from: int | Sequence[int] = 1, *,
                    model: str | None = None, rollout_log_probs: Sequence[Sequence[float]] | None = None,
                    **options: Unpack[ScoringOptions]) -> list[SequenceLogProbs]:
        return await self._run(self._score(input_ids, score_from, model, rollout_log_probs=rollout_log_probs,
                                           **options))

    async def reload(self, model: str, path: str, *, allow_non_finite: bool = False) -> ModelInfo:
        return await self._run(self._reload(model, path, allow_non_finite))

    async def ready(self) -> bool:
        return await self._run(self._up("/readyz"))

    async def alive(self) -> bool:
        return await self._run(self._up("/healthz"))

    async def metrics(self) -> str:
        return await self._run(self._metrics())

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncLogProbClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def connect_pool(model: str = "policy", *, service: str = "ppo_logprobs", address: str = "auto"):
    """The WorkerPool of `model` in a running service (started with --pool-name `service`), for a trainer on
    the same Ray cluster; joins the cluster at `address` when this process has not yet (with "auto", the Ray
    running on this machine, wherever it listens). A trainer on another machine joins that machine to the
    cluster first (`ray start --address=<head>:6379`); without a Ray node here this raises ConnectionError."""
    import ray

    from ppo_logprobs.workers import WorkerPool

    if not ray.is_initialized():
        _join_loopback_ray(address)
        if address != "auto":  # Ray sends this machine's token only to a Ray it found itself: do the same here
            from ray._private.authentication.authentication_token_setup import (
                maybe_enable_token_auth_if_token_available,
            )

            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        try:
            ray.init(address=address)
        except ConnectionError as e:
            if address == "auto" or os.environ.get("RAY_AUTH_MODE") == "token":
                raise
            raise ConnectionError(f"{e}. If the cluster uses token authentication, give this machine its token "
                                  "(~/.ray/auth_token, or RAY_AUTH_TOKEN) and set RAY_AUTH_MODE=token") from e
    return WorkerPool.connect(f"{service}:{model}")


def _join_loopback_ray(address: str) -> None:
    """A service started on loopback (`make serve`) keeps its Ray on 127.0.0.1, where a driver would not look: Ray
    dials the machine's own address (also for an `address` of 127.0.0.1) unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    was set before it was imported. When the Ray at `address` ("auto": the one Ray on this machine) listens on
    loopback only, this process joins it there. A driver attaches to a Ray node on its own machine; where there is
    none (a machine that has not joined the cluster), Ray would wait a minute and fail without saying so."""
    import ipaddress

    from ray._private import ray_constants, services

    target = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
    if target.startswith("ray://"):  # Ray Client: no node of its own needed, nothing to rewrite
        return
    if not services.find_node_ids():
        head = address if address != "auto" else "<head>:6379"
        raise ConnectionError(f"no Ray node runs on this machine, and connect_pool attaches to one: join the "
                              f"service's cluster here first (`ray start --address={head}`, the head's address)")

    def on_loopback(addr: str) -> bool:
        host = addr.rsplit(":", 1)[0].strip("[]")
        try:
            return host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name: Ray's own resolution applies
            return False

    found = services.find_gcs_addresses()  # the GCS addresses this machine's Ray nodes were started with
    if address == "auto":
        loopback = len(found) == 1 and on_loopback(next(iter(found)))  # none or several: Ray's own choice applies
    else:  # a loopback address of a Ray that listens on the machine's own address is left to Ray's rewrite
        port = address.rsplit(":", 1)[-1]
        loopback = on_loopback(address) and any(on_loopback(a) and a.rsplit(":", 1)[-1] == port for a in found)
    if loopback:
        os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"  # for the processes this one starts
        ray_constants.ENABLE_RAY_CLUSTER = False  # read when this process picks its node address
