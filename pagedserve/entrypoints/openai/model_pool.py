"""Several models behind one server: which are servable, which are loaded, and when
one is loaded or unloaded (Ollama's `keep_alive` and OLLAMA_MAX_LOADED_MODELS,
llama-server's router mode).

A second model is a second engine core behind the same front end: each loaded model
has its own AsyncLLM (engine thread, KV cache, serving handlers).  The pool decides
only their lifetimes:
- a request leases its model (`ModelPool.lease`), loading it first when needed; a
  model with a lease out is never unloaded, so requests already running on it finish;
- loads are serialized (one lock), and concurrent first requests for one model wait on
  the same load, which runs once;
- a model loads only when it fits: at most `max_loaded` at once and, under a memory
  budget, its reservation (weights and KV cache) beside the loaded ones'; idle models
  are unloaded least recently used first to make room, and a request waits (bounded)
  while every loaded model is busy;
- once its last lease ends a model stays loaded for its keep-alive (the server's
  default, or the last request's `keep_alive`): 0 unloads it at once, None keeps it.

Requests never name files: a request can only pick one of the pool's `ModelSpec`s.
A model that fails to load fails the requests that waited for it, with its name and
the reason; the others keep serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pagedserve.entrypoints.openai.serving_engine import OpenAIError
from pagedserve.model_loader.model_facts import weights_estimate
from pagedserve.utils import rss_bytes
from pagedserve.worker.cpu_malloc import collect_and_release

logger = logging.getLogger(__name__)

H = TypeVar("H")  # what a loaded model is to the server (its serving handlers)

DEFAULT_KEEP_ALIVE = 300.0  # Ollama's: 5 minutes after the last request
# How long a request waits for its model to load, or for room to load it in.
LOAD_WAIT_SECONDS = 600.0
REAP_INTERVAL = 0.5  # seconds between checks for models past their keep-alive
# A model whose load failed answers its requests with that failure for this long, without
# trying again (each try could first unload an idle model to make room for it).
FAILED_LOAD_SECONDS = 30.0
# Go's time.ParseDuration: one optional sign before the whole, then numbers (ASCII digits,
# "5", "1.5", ".5", "5.") each with its unit; a plain number is Ollama's seconds.
_DURATION = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)(ns|us|µs|ms|s|m|h)")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_KEEP_ALIVE_SECONDS = 10 * 365 * 86400.0  # longer is "forever" anyway


def _load_failed(model: ServedModel[Any], kind: str) -> OpenAIError:
    """A failed load's answer: the model and the exception's type (its message, which may
    hold the server's paths, is the log's)."""
    return OpenAIError(f"model {model.spec.name!r} could not be loaded ({kind}; details in the server log)",
                       status=500, type="server_error", param="model", code="model_load_failed")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # a request that did not say keep_alive


def parse_keep_alive(value: object, what: str = "keep_alive") -> float | None:
    """Ollama's keep_alive forms as seconds: a number of seconds, or a Go duration
    ("5m", "1h30m", "10s", "0"); negative means forever (None).  ValueError names `what`."""
    seconds: float
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{what} must be a duration such as '5m' or a number of seconds, got {value!r}")
    if isinstance(value, int) and abs(value) > 1 << 62:  # (past float's range too: forever either way)
        seconds = math.inf if value > 0 else -math.inf
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if _NUMBER.fullmatch(text):
            seconds = float(text)
        else:
            sign, body = (-1.0, text[1:]) if text[:1] == "-" else (1.0, text.removeprefix("+"))
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"{what} must be a duration such as '5m', '1h' or '30s', or a number of seconds; "
                                 f"got {value[:100]!r}") from None
            seconds = sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    else:
        raise ValueError(f"{what} must be a duration such as '5m' or a number of seconds, got {type(value).__name__}")
    if seconds != seconds:  # NaN
        raise ValueError(f"{what} must be a number, got NaN")
    if seconds < 0 or seconds > MAX_KEEP_ALIVE_SECONDS:
        return None
    return seconds


LATEST_TAG = ":latest"


def without_latest(name: str) -> str:
    """Ollama's `NAME:latest` is `NAME` (the tag clients add when none is given), so no
    served name ends with it: one would be unreachable on Ollama's routes, or another's."""
    return name[: -len(LATEST_TAG)] if name.endswith(LATEST_TAG) and len(name) > len(LATEST_TAG) else name


def check_not_latest(name: str, what: str) -> None:
    """A served name (`what`: which) must not end with :latest (without_latest says why)."""
    if without_latest(name) != name:
        raise ValueError(f"{what} {name!r}: Ollama's routes read NAME{LATEST_TAG} as NAME, so no served name ends "
                         f"with {LATEST_TAG}; name it {without_latest(name)!r}")


@dataclass(frozen=True)
class ModelSpec:
    """A model the server may load: the name clients use and what loads it.  `source`
    (a registered name, directory or file) is the operator's, never shown to clients."""

    name: str
    source: str
    aliases: tuple[str, ...] = ()  # further names for it (--served-model-name)


class ServedModel(Generic[H]):
    """One model of the pool and its state (event loop only)."""

    def __init__(self, spec: ModelSpec, keep_alive: float | None) -> None:
        self.spec = spec
        self.loaded: H | None = None
        self.loading: asyncio.Future[None] | None = None
        self.leases = 0
        self.keep_alive = keep_alive  # after the last lease; the last request's keep_alive sets it
        self.last_used = 0.0
        self.expires_at: float | None = None  # monotonic; None while leased or kept forever
        self.reserved_bytes = 0  # what it counts against the memory budget while loaded
        self.measured_bytes: int | None = None  # resident growth its last load measured
        self.kv_bytes: int | None = None  # its KV cache's size, as its last load sized it
        self.footprint_bytes = 0  # all it holds once its KV cache's pages are touched (/api/ps)
        self.load_seconds = 0.0
        self.pinned = False  # attached from outside (no loader): never unloaded
        self.failure: tuple[float, str] | None = None  # (when, exception type) of its last failed load
        self.max_model_len: int | None = None  # what its config and the server's flags give (ModelPool.check)
        self.checked = False  # whether `max_model_len` was looked for
        self.counters = PoolCounters()


@dataclass
class PoolCounters:
    """What /metrics shows of a model's loads (pagedserve:model_loads and the rest)."""

    loads: int = 0
    unloads: int = 0
    load_failures: int = 0


class Lease(Generic[H]):
    """A request's hold on a loaded model: the model stays loaded until every lease on
    it is released (release is idempotent)."""

    def __init__(self, pool: ModelPool[H], model: ServedModel[H], handlers: H) -> None:
        self.pool, self.model, self.handlers = pool, model, handlers
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool.release(self.model)


class ModelPool(Generic[H]):
    """The servable models by name, loading and unloading them as requests come.

    `load(spec, kv_cache_bytes)` builds a model's handlers (its engine loaded and
    started); `unload(handlers)` stops that engine.  Without them (a server built around
    an engine made elsewhere, as tests do) every model is attached and pinned."""

    def __init__(self, specs: list[ModelSpec], *, max_loaded: int = 1, memory_budget: int | None = None,
                 keep_alive: float | None = None,
                 load: Callable[[ModelSpec, int | None], Awaitable[H]] | None = None,
                 unload: Callable[[H], Awaitable[None]] | None = None,
                 estimate: Callable[[ModelSpec], int] = lambda spec: weights_estimate(spec.source),
                 kv_cache_bytes: int | None = None, clock: Callable[[], float] = time.monotonic,
                 max_waiting: int | None = None,
                 check: Callable[[ModelSpec], int | None] = lambda spec: None) -> None:
        """`kv_cache_bytes`: each model's KV cache; None: sized within the budget (the
        budget's share per loaded model, less the model's weights), or by the engine's
        own rule when there is no budget.  `max_waiting`: requests that may wait for a
        model to load (--max-waiting-requests; past it a 503 at once).  `check`: what can
        be known of a load without loading: its failure (the model's config against the
        server's flags, a ValueError before anything is unloaded for it), else the
        max_model_len it will serve (None: not known before it loads)."""
        if not specs:
            raise ValueError("a server needs at least one model")
        if max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {max_loaded}")
        if memory_budget is not None and memory_budget <= 0:
            raise ValueError(f"the models' memory budget must be positive, got {memory_budget}")
        self.models: dict[str, ServedModel[H]] = {}
        self._names: dict[str, str] = {}  # every name and alias -> the model's name
        for spec in specs:
            for name in (spec.name, *spec.aliases):
                if name in self._names:
                    raise ValueError(f"two models are served under the name {name!r}; rename one "
                                     "(a file or folder's name is its model's name)")
                self._names[name] = spec.name
            self.models[spec.name] = ServedModel(spec, keep_alive)
        self.default_name = specs[0].name
        self.default_keep_alive = keep_alive
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.kv_cache_bytes = kv_cache_bytes
        self._load, self._unload, self._estimate, self._clock, self._check = load, unload, estimate, clock, check
        self._kv_bytes: Callable[[H], int | None] = lambda handlers: None
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._released = asyncio.Event()  # set when a lease ends (a waiting load may find room)
        # A load waiting for a loaded model to go idle: new requests for loaded models wait
        # behind it (first come, first served), else a busy model would starve the others.
        self._room_waiters = 0
        self._room_turn = asyncio.Event()  # set when such a load stops waiting
        self.max_waiting = max_waiting
        self._waiting_for_load = 0
        self._reaper: asyncio.Task[None] | None = None
        self.closed = False

    # ------------------------------------------------------------------ lookup
    def resolve(self, requested: str | None) -> str | None:
        """The model a requested name (or alias) serves; None: not one of ours."""
        if requested is None:
            return self.default_name
        return self._names.get(requested)

    def names(self) -> list[str]:
        return list(self._names)

    def loaded(self) -> Iterator[tuple[ServedModel[H], H]]:
        for model in list(self.models.values()):
            if model.loaded is not None:
                yield model, model.loaded

    def expires_at_wall(self, model: ServedModel[H]) -> float | None:
        """When `model` unloads if nothing uses it (a Unix time), None: kept for good.  While
        requests hold it, its keep-alive from now: the soonest its last request could end."""
        if model.expires_at is None:
            return None if model.keep_alive is None else time.time() + model.keep_alive
        return time.time() + (model.expires_at - self._clock())

    def handlers(self, name: str) -> H | None:
        return self.models[name].loaded

    def expected_max_model_len(self, name: str) -> int | None:
        """The max_model_len `name` serves once loaded, from its config and the server's
        flags (vLLM's /v1/models field, for a model not loaded yet); None where that is
        not known before loading.  Reads files: off the event loop, found once."""
        model = self.models[name]
        if not model.checked:
            try:
                model.max_model_len = self._check(model.spec)
            except Exception:  # noqa: BLE001 - a model that will fail to load has none to show
                model.max_model_len = None
            model.checked = True
        return model.max_model_len

    def set_loader(self, load: Callable[[ModelSpec, int | None], Awaitable[H]], unload: Callable[[H], Awaitable[None]],
                   kv_bytes: Callable[[H], int | None] = lambda handlers: None) -> None:
        """Load models on demand (a server of several models); before any is attached.
        `kv_bytes`: the KV cache a loaded model's engine sized (the KV share asked for is
        a ceiling: an engine holds no more than its max_num_seqs x max_model_len can use);
        None: unknown, the share is counted."""
        self._load, self._unload, self._kv_bytes = load, unload, kv_bytes

    @property
    def can_load(self) -> bool:
        return self._load is not None

    def attach(self, name: str, handlers: H, kv_bytes: int | None = None) -> None:
        """A model loaded elsewhere (the server's start-up, or a test's engine), its KV
        cache `kv_bytes`.  Without a loader it can never come back, so it is pinned."""
        model = self.models[self._names[name]]
        model.loaded = handlers
        model.last_used = self._clock()
        model.pinned = self._load is None
        try:
            model.reserved_bytes = max(self._estimate(model.spec), 0)
        except ValueError:  # (its facts unreadable, yet it loaded: nothing is known of its size)
            model.reserved_bytes = 0
        model.kv_bytes = kv_bytes
        model.footprint_bytes = model.reserved_bytes + (kv_bytes or 0)

    # ------------------------------------------------------------------ leases
    async def lease(self, name: str, keep_alive: Any = UNSET, wait: float = LOAD_WAIT_SECONDS) -> Lease[H]:
        """Hold `name` loaded for a request, loading it first if needed (waiting at most
        `wait` seconds).  `keep_alive`: the request's (seconds, None: forever)."""
        model = self.models[self._names[name]]
        # A server that cannot load models keeps its own loaded for good: every keep_alive
        # but an unload (0) is met by that (Ollama's keep_alive is how long at least).
        if keep_alive is not UNSET and not self.can_load and keep_alive is not None and keep_alive <= 0:
            raise OpenAIError("keep_alive 0 (unload after the request): this server cannot load models on demand, "
                              "so it keeps its model loaded", param="keep_alive")
        deadline = self._clock() + wait
        await self._wait_turn(model, deadline)
        if self.can_load:  # the request's keep_alive, else the server's (as Ollama: the last request decides)
            model.keep_alive = self.default_keep_alive if keep_alive is UNSET else keep_alive
        model.leases += 1  # before any await: an unload decided meanwhile passes this model by
        model.expires_at = None
        try:
            if model.loaded is None:
                await self._wait_for_load(model, deadline)
            model.last_used = self._clock()
            assert model.loaded is not None
            return Lease(self, model, model.loaded)
        except BaseException:
            self.release(model)
            raise

    async def _wait_turn(self, model: ServedModel[H], deadline: float) -> None:
        """A loaded model's new request waits while another model's load waits for room."""
        while self._room_waiters and model.loaded is not None and not model.pinned:
            self._room_turn.clear()
            try:
                await asyncio.wait_for(self._room_turn.wait(), max(deadline - self._clock(), 0.001))
            except TimeoutError:
                raise OpenAIError(f"model {model.spec.name!r} is busy while another model waits to load; retry "
                                  "shortly", status=503, type="server_error", code="server_overloaded") from None

    async def _wait_for_load(self, model: ServedModel[H], deadline: float) -> None:
        """Load `model` (or wait for its load), within the waiting bound and the deadline."""
        if model.failure is not None and self._clock() - model.failure[0] < FAILED_LOAD_SECONDS:
            raise _load_failed(model, model.failure[1])  # (the same answer, no new try: it failed moments ago)
        if self.max_waiting is not None and self._waiting_for_load >= self.max_waiting:
            raise OpenAIError(f"{self._waiting_for_load} requests already wait for a model to load "
                              "(--max-waiting-requests); retry shortly", status=503, type="server_error",
                              code="server_overloaded")
        self._waiting_for_load += 1
        try:
            while model.loaded is None:
                if self.closed:
                    raise OpenAIError("The server is shutting down.", status=503, type="server_error",
                                      code="shutting_down")
                if model.loading is None or model.loading.done():  # (a load that gave up: its callback may not have run)
                    model.loading = asyncio.ensure_future(self._load_one(model, deadline))
                    model.loading.add_done_callback(_forget_loading(model))
                try:  # (a load waiting for room gives up at the deadline itself, saying why)
                    await asyncio.wait_for(asyncio.shield(model.loading), max(deadline - self._clock(), 0) + 1.0)
                except TimeoutError:
                    raise OpenAIError(f"model {model.spec.name!r} is still loading; retry shortly", status=503,
                                      type="server_error", code="model_loading") from None
        finally:
            self._waiting_for_load -= 1

    def release(self, model: ServedModel[H]) -> None:
        model.leases -= 1
        model.last_used = self._clock()
        if model.leases == 0 and model.loaded is not None and not model.pinned:
            if model.keep_alive is None:
                model.expires_at = None
            else:
                model.expires_at = model.last_used + model.keep_alive
                if model.keep_alive == 0:
                    asyncio.ensure_future(self.reap())
        self._released.set()

    # ------------------------------------------------------------------ loading
    def reservation(self, model: ServedModel[H]) -> tuple[int, int, int | None]:
        """(bytes the model is priced at, bytes it counts against the budget, its KV
        cache's bytes to ask for).  The price is its weights' size on disk plus its KV
        cache, the budget's share per loaded model less those weights (the most the cache's
        lazily mapped pages may grow to): the same on every load, so a model that loaded
        once loads again.  What it counts (which other models make room for it) is its
        last load's resident growth where that was more than its weights, and the KV
        cache its last load sized where that was less than the share, at most the whole
        budget (counting a small model's whole share and its runtime's growth besides
        made two models that fit together unload each other on every switch)."""
        estimate = max(self._estimate(model.spec), 0)
        kv = self.kv_cache_bytes
        if kv is None and self.memory_budget is not None:
            kv = self.memory_budget // self.max_loaded - estimate
            if kv <= 0:
                lower = " or lower --max-loaded-models" if self.max_loaded > 1 else ""
                raise OpenAIError(
                    f"the weights of model {model.spec.name!r} (about {estimate / 2**30:.2f} GiB) fill its share of "
                    f"the models' memory budget ({self.memory_budget / 2**30:.2f} GiB over --max-loaded-models "
                    f"{self.max_loaded}), leaving nothing for its KV cache: raise --max-models-memory{lower}",
                    status=500, type="server_error", param="model", code="model_too_large")
        price = estimate + (kv or 0)
        return price, self.counted(model, estimate, model.measured_bytes or 0, kv), kv

    def counted(self, model: ServedModel[H], estimate: int, grown: int, kv: int | None) -> int:
        """What a model counts against the budget (reservation says why): the larger of its
        weights and its measured growth, plus the KV cache its engine sized (at most `kv`,
        the share it was given), at most the whole budget.  A cache sized to fill the
        budget's share beside the weights on disk counts only what the share leaves beside
        the growth: the runtime's growth past the file (149 MB for SmolLM2's 98, 538 for
        Gemma 3's 253) made two models that each took their whole share never fit together
        under --max-loaded-models 2, unloading each other on every switch."""
        held = kv if kv is None or model.kv_bytes is None else min(kv, model.kv_bytes)
        counted = max(estimate, grown) + (held or 0)
        if self.memory_budget is None:
            return counted
        if self.kv_cache_bytes is None and held is not None:  # (the share, not --kv-cache-memory-bytes)
            counted = min(counted, max(self.memory_budget // self.max_loaded, estimate, grown))
        return min(counted, self.memory_budget)

    async def _load_one(self, model: ServedModel[H], deadline: float) -> None:
        assert self._load is not None, "attached models are never unloaded"
        async with self._lock:
            if model.loaded is not None or model.leases == 0:  # (loaded, or no request waits for it now)
                return
            try:  # (its files' facts are read off the event loop: a hostile file is slow to read)
                model.max_model_len = await asyncio.to_thread(self._check, model.spec)
                model.checked = True
                price, need, kv = await asyncio.to_thread(self.reservation, model)
            except OpenAIError:
                raise
            except Exception as e:  # noqa: BLE001 - unreadable facts are this model's failure
                raise self._failed(model, e) from None
            await self._make_room(model, price, need, deadline)
            if model.leases == 0:  # (its requests went while it waited: it gave up, having loaded nothing)
                return
            before = rss_bytes(os.getpid())
            start = self._clock()
            failure: OpenAIError | None = None
            try:
                handlers = await self._load(model.spec, kv)
            except OpenAIError as e:
                model.counters.load_failures += 1
                failure, e.__traceback__ = e, None
            except Exception as e:  # noqa: BLE001 - any load failure is this model's, by name
                failure, e.__traceback__ = self._failed(model, e), None
            if failure is not None:
                # The failure's frames held the half-built model: freed before answering (the
                # next try comes FAILED_LOAD_SECONDS later), not at the next full collection.
                failure.__context__ = failure.__cause__ = None
                await asyncio.to_thread(collect_and_release)
                raise failure
            model.failure = None
            model.load_seconds = self._clock() - start
            grown = rss_bytes(os.getpid()) - before
            if grown > 0:
                model.measured_bytes = grown
            model.kv_bytes = self._kv_bytes(handlers)
            model.footprint_bytes = max(price - (kv or 0), grown) + (model.kv_bytes or kv or 0)
            model.reserved_bytes = need if self.memory_budget is None else self.counted(
                model, price - (kv or 0), grown, kv)  # (price less the cache: its size on disk)
            model.loaded = handlers
            model.last_used = self._clock()
            model.counters.loads += 1
            logger.info("model %r loaded in %.1f s (%.0f MiB resident)", model.spec.name, model.load_seconds,
                        max(grown, 0) / 2**20)

    def _failed(self, model: ServedModel[H], e: Exception) -> OpenAIError:
        """A failed load's answer, remembered for FAILED_LOAD_SECONDS; its details (the
        server's paths, the loader's internals) go to the log only."""
        model.counters.load_failures += 1
        # (the traceback as text: a record that kept its frames would keep the half-built model)
        logger.error("model %r failed to load (%s: %s)\n%s", model.spec.name, type(e).__name__, e,
                     "".join(traceback.format_exception(e)).rstrip())
        model.failure = (self._clock(), type(e).__name__)
        return _load_failed(model, type(e).__name__)

    def _fits(self, need: int) -> bool:
        loaded = [m for m, _ in self.loaded()]
        if len(loaded) >= self.max_loaded:
            return False
        return self.memory_budget is None or sum(m.reserved_bytes for m in loaded) + need <= self.memory_budget

    async def _make_room(self, model: ServedModel[H], price: int, need: int, deadline: float) -> None:
        """Unload idle models, least recently used first, until `model` fits (`need`
        beside the loaded ones); wait while the ones in the way are busy, for as long as
        a request still waits for `model` (an abandoned load unloads nothing and holds
        up no one).  Refused where its `price` is over the whole budget.  Called under the lock."""
        if self.memory_budget is not None and price > self.memory_budget:
            raise OpenAIError(f"model {model.spec.name!r} needs about {price / 2**30:.2f} GiB, more than the "
                              f"models' memory budget ({self.memory_budget / 2**30:.2f} GiB, --max-models-memory)",
                              status=500, type="server_error", param="model", code="model_too_large")
        while not self._fits(need):
            if model.leases == 0:  # every request for it has gone (hung up, timed out): no room is made
                return
            idle = sorted((m for m, _ in self.loaded() if m.leases == 0 and not m.pinned), key=lambda m: m.last_used)
            if idle:
                await self._unload_one(idle[0], "to make room for " + repr(model.spec.name))
                continue
            self._released.clear()
            self._room_waiters += 1
            try:
                await asyncio.wait_for(self._released.wait(), max(deadline - self._clock(), 0.001))
            except TimeoutError:
                raise OpenAIError(f"model {model.spec.name!r} cannot load while every loaded model is busy "
                                  f"(--max-loaded-models {self.max_loaded}); retry shortly", status=503,
                                  type="server_error", code="server_overloaded") from None
            finally:
                self._room_waiters -= 1
                self._room_turn.set()

    async def _unload_one(self, model: ServedModel[H], why: str) -> None:
        handlers = model.loaded
        assert handlers is not None and self._unload is not None
        model.loaded = None
        model.expires_at = None
        model.reserved_bytes = 0
        before = rss_bytes(os.getpid())
        await self._unload(handlers)
        del handlers
        await asyncio.to_thread(collect_and_release)  # (resident memory falls only with this)
        model.counters.unloads += 1
        logger.info("model %r unloaded (%s; resident memory %+.0f MiB)", model.spec.name, why,
                    (rss_bytes(os.getpid()) - before) / 2**20)

    async def unload(self, name: str, asked: bool = False) -> bool:
        """Unload `name` now if no request holds it (False if held or not loaded); one
        still held unloads as its last request ends.  `asked`: a client's keep_alive 0,
        refused (a 400) where models cannot be loaded again."""
        model = self.models[self._names[name]]
        if model.pinned and asked:
            raise OpenAIError("keep_alive: this server serves one model and keeps it loaded; serve several "
                              "(`pagedserve serve MODEL MODEL ...` or --models-dir) to unload them on demand",
                              param="keep_alive")
        async with self._lock:
            if model.loaded is None or model.pinned:
                return False
            if model.leases:
                model.keep_alive = 0
                return False
            await self._unload_one(model, "asked")
            return True

    async def reap(self) -> None:
        """Unload the idle models whose keep-alive has run out."""
        now = self._clock()
        for model in list(self.models.values()):
            if model.expires_at is not None and model.expires_at <= now and model.leases == 0:
                async with self._lock:
                    if model.loaded is not None and model.leases == 0 and model.expires_at is not None \
                            and model.expires_at <= self._clock():
                        await self._unload_one(model, "keep_alive expired")

    def start(self) -> None:
        """Start checking keep-alives (on the running event loop; idempotent)."""
        if self._reaper is None and self.can_load:
            self._reaper = asyncio.ensure_future(self._reap_forever())

    async def _reap_forever(self) -> None:
        while not self.closed:
            await asyncio.sleep(REAP_INTERVAL)
            try:
                await self.reap()
            except Exception:  # noqa: BLE001 - one failed unload must not stop the others' expiry
                logger.exception("unloading an expired model failed")

    @property
    def leased(self) -> int:
        """Requests holding a model, from before its load to their answer's end (a drain
        waits for them: one waiting for a load has no engine request yet)."""
        return sum(model.leases for model in self.models.values())

    def close(self) -> None:
        """No more loads (shutdown)."""
        self.closed = True
        if self._reaper is not None:
            self._reaper.cancel()


def _forget_loading(model: ServedModel[Any]) -> Callable[[asyncio.Future[None]], None]:
    def done(future: asyncio.Future[None]) -> None:
        if model.loading is future:  # (not a newer load started before this callback ran)
            model.loading = None
        if not future.cancelled():
            future.exception()  # retrieved: each waiter raised it already
    return done


def register_pool_metrics(registry: Any, pool: ModelPool[Any]) -> None:
    """The pool on /metrics, by model_name: loads, unloads and failed loads so far, and
    which models are loaded (pagedserve:model_loaded)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self) -> Iterator[Any]:
            families = [CounterMetricFamily(f"pagedserve:model_{field}", doc, labels=["model_name"])
                        for field, doc in (("loads", "Models loaded on demand."),
                                           ("unloads", "Models unloaded (keep_alive, or for room)."),
                                           ("load_failures", "Model loads that failed."))]
            loaded = GaugeMetricFamily("pagedserve:model_loaded", "1 while the model is loaded.", labels=["model_name"])
            for name, model in pool.models.items():
                c = model.counters
                for family, value in zip(families, (c.loads, c.unloads, c.load_failures), strict=True):
                    family.add_metric([name], value)
                loaded.add_metric([name], 1.0 if model.loaded is not None else 0.0)
            yield from families
            yield loaded

    registry.register(Collector())
