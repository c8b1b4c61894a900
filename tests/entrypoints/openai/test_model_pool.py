"""ModelPool's lifetimes with a fake loader: loads serialized and run once, least
recently used idle models unloaded for room, busy ones waited for, keep_alive expiry
and 0, a failed load naming its model, and the memory budget."""

from __future__ import annotations

import asyncio
import functools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.entrypoints.openai.model_pool import ModelPool, ModelSpec, parse_keep_alive
from pagedserve.entrypoints.openai.serving_engine import OpenAIError


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Loader:
    """Records loads and unloads; a load takes `delay` seconds; `fail` names models whose load raises."""

    def __init__(self, delay: float = 0.0, fail: frozenset[str] = frozenset()) -> None:
        self.delay, self.fail = delay, fail
        self.events: list[str] = []
        self.kv: dict[str, int | None] = {}

    async def load(self, spec: ModelSpec, kv: int | None) -> str:
        self.events.append(f"load {spec.name}")
        await asyncio.sleep(self.delay)
        if spec.name in self.fail:
            raise RuntimeError("weights are corrupt")
        self.kv[spec.name] = kv
        return f"handlers of {spec.name}"

    async def unload(self, handlers: str) -> None:
        self.events.append(f"unload {handlers.removeprefix('handlers of ')}")


def make_pool(names: tuple[str, ...] = ("a", "b", "c"), loader: Loader | None = None, **kw) -> tuple[ModelPool, Loader]:
    loader = loader or Loader()
    pool = ModelPool([ModelSpec(n, f"/models/{n}.gguf") for n in names], estimate=lambda spec: 100, **kw)
    pool.set_loader(loader.load, loader.unload)
    return pool, loader


def run(coro):
    return asyncio.run(coro)


def test_keep_alive_forms() -> None:
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("10s") == 10
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0 and parse_keep_alive(2.5) == 2.5
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None and parse_keep_alive("-1h5m") is None
    assert parse_keep_alive("+1m30s") == 90 and parse_keep_alive(".5m") == 30 and parse_keep_alive("5.m") == 300
    assert parse_keep_alive(10**400) is None and parse_keep_alive(-(10**400)) is None  # (past float's range)
    for bad in ("soon", "5 minutes", True, None, [1], "1e999x", "1h-5m", "1h+5m", "--5m",  # (Go: one leading sign)
                "\N{ARABIC-INDIC DIGIT ONE}m", "\N{ARABIC-INDIC DIGIT ONE}", "1_000", "inf", "nan", "1e3"):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_keep_alive(bad)


@given(st.text(max_size=30))
def test_keep_alive_text_never_crashes(text: str) -> None:
    try:
        value = parse_keep_alive(text)
    except ValueError:
        return
    assert value is None or value >= 0


def test_concurrent_first_requests_load_once() -> None:
    async def main():
        pool, loader = make_pool(loader=Loader(delay=0.05))
        leases = await asyncio.gather(*(pool.lease("a") for _ in range(8)))
        assert {lease.handlers for lease in leases} == {"handlers of a"}
        for lease in leases:
            lease.release()
        return loader.events, pool.models["a"].counters.loads

    events, loads = run(main())
    assert events == ["load a"] and loads == 1


def test_one_loaded_at_a_time_least_recently_used_goes_first() -> None:
    async def main():
        pool, loader = make_pool(max_loaded=2, keep_alive=None)
        for name in ("a", "b", "a", "c"):  # c needs room: b was used least recently
            (await pool.lease(name)).release()
        return loader.events, sorted(m.spec.name for m, _ in pool.loaded())

    events, loaded = run(main())
    assert events == ["load a", "load b", "unload b", "load c"] and loaded == ["a", "c"]


def test_a_busy_model_is_not_unloaded_and_the_load_waits_for_it() -> None:
    async def main():
        pool, loader = make_pool(keep_alive=None)
        held = await pool.lease("a")
        waiting = asyncio.ensure_future(pool.lease("b"))
        await asyncio.sleep(0.05)
        assert not waiting.done() and loader.events == ["load a"]  # a's request is still running
        held.release()
        (await waiting).release()
        with pytest.raises(OpenAIError, match="busy") as e:  # and a bounded wait, else a 503
            held = await pool.lease("b")
            await pool.lease("a", wait=0.05)
        assert e.value.status == 503
        return loader.events

    assert run(main()) == ["load a", "unload a", "load b"]


def test_keep_alive_expiry_and_zero() -> None:
    async def main():
        clock = FakeClock()
        pool, loader = make_pool(keep_alive=300.0, clock=clock)
        (await pool.lease("a")).release()
        clock.t += 299
        await pool.reap()
        assert pool.handlers("a") is not None
        clock.t += 2
        await pool.reap()
        assert pool.handlers("a") is None
        (await pool.lease("b", keep_alive=0)).release()  # a request's keep_alive 0: gone after it
        await asyncio.sleep(0.01)
        assert pool.handlers("b") is None
        (await pool.lease("c", keep_alive=None)).release()  # -1: kept
        clock.t += 10**6
        await pool.reap()
        assert pool.handlers("c") is not None
        (await pool.lease("c")).release()  # a request without keep_alive: the server's again
        clock.t += 301
        await pool.reap()
        assert pool.handlers("c") is None
        return loader.events

    assert run(main()) == ["load a", "unload a", "load b", "unload b", "load c", "unload c"]


def test_a_failed_load_names_the_model_and_the_others_serve() -> None:
    """The failure names the model and its exception's type (its details, which may hold
    the server's paths, go to the log); for FAILED_LOAD_SECONDS it is the answer without
    a new try (which would first unload an idle model to make room), then tried again."""
    from pagedserve.entrypoints.openai.model_pool import FAILED_LOAD_SECONDS

    clock = FakeClock()

    async def main():
        pool, loader = make_pool(loader=Loader(fail=frozenset({"b"})), clock=clock)
        with pytest.raises(OpenAIError) as e:
            await pool.lease("b")
        assert "'b'" in e.value.message and "RuntimeError" in e.value.message and e.value.status == 500
        assert "weights are corrupt" not in e.value.message
        lease = await pool.lease("a")
        lease.release()
        with pytest.raises(OpenAIError, match="could not be loaded"):  # remembered: "a" stays loaded
            await pool.lease("b")
        assert pool.models["a"].loaded is not None
        clock.t += FAILED_LOAD_SECONDS + 1
        with pytest.raises(OpenAIError):  # tried again once that time has passed
            await pool.lease("b")
        return loader.events, pool.models["b"].counters.load_failures

    events, failures = run(main())
    assert events == ["load b", "load a", "unload a", "load b"] and failures == 2


def test_metrics_count_loads_unloads_and_failures_by_model() -> None:
    from prometheus_client import CollectorRegistry

    from pagedserve.entrypoints.openai.model_pool import register_pool_metrics

    async def main():
        pool, loader = make_pool(loader=Loader(fail=frozenset({"c"})))
        for name in ("a", "b", "a"):  # (one loaded at a time: each load unloads the other, c's too)
            (await pool.lease(name)).release()
        with pytest.raises(OpenAIError):
            await pool.lease("c")
        return pool

    pool = run(main())
    registry = CollectorRegistry()
    register_pool_metrics(registry, pool)
    value = registry.get_sample_value
    assert [value("pagedserve:model_loads_total", {"model_name": n}) for n in "abc"] == [2, 1, 0]
    assert [value("pagedserve:model_unloads_total", {"model_name": n}) for n in "abc"] == [2, 1, 0]
    assert [value("pagedserve:model_load_failures_total", {"model_name": n}) for n in "abc"] == [0, 0, 1]
    assert [value("pagedserve:model_loaded", {"model_name": n}) for n in "abc"] == [0, 0, 0]


def test_a_busy_model_does_not_starve_a_load_waiting_for_room() -> None:
    """Requests for a loaded, busy model that arrive while another model waits for room
    wait their turn behind that load (first come, first served)."""
    async def main():
        pool, loader = make_pool()
        busy = await pool.lease("a")
        b = asyncio.ensure_future(pool.lease("b"))  # waits for "a" to go idle
        await asyncio.sleep(0.05)
        later_a = asyncio.ensure_future(pool.lease("a"))  # arrives after: must not keep "a" busy
        await asyncio.sleep(0.05)
        assert not later_a.done()
        busy.release()
        lease_b = await asyncio.wait_for(b, 5)
        assert not later_a.done()  # "a" was unloaded for "b"; it loads again once "b" is idle
        lease_b.release()
        (await asyncio.wait_for(later_a, 5)).release()
        return loader.events

    assert run(main()) == ["load a", "unload a", "load b", "unload b", "load a"]


def test_requests_waiting_for_a_load_are_bounded() -> None:
    async def main():
        pool, _ = make_pool(loader=Loader(delay=0.2), max_waiting=2)
        waiting = [asyncio.ensure_future(pool.lease("a")) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(OpenAIError, match="already wait for a model to load") as e:
            await pool.lease("a")
        assert e.value.status == 503
        for lease in await asyncio.gather(*waiting):
            lease.release()
        (await pool.lease("a")).release()  # loaded now: no waiting, no bound

    run(main())


def test_memory_budget_sizes_caches_and_refuses_a_model_that_cannot_fit() -> None:
    async def main():
        pool, loader = make_pool(max_loaded=2, memory_budget=1000)
        (await pool.lease("a")).release()
        assert loader.kv["a"] == 1000 // 2 - 100  # the budget's share per model, less its weights
        fixed, _ = make_pool(memory_budget=150, kv_cache_bytes=100)  # (--kv-cache-memory-bytes)
        with pytest.raises(OpenAIError, match="more than the models' memory budget"):
            await fixed.lease("a")
        # Weights that fill their share leave no KV cache: refused, not loaded with the
        # engine's own cache size (a KV share of 0 once read as "not set": 5.6x the budget).
        for budget, max_loaded in ((50, 1), (300, 3)):
            full, full_loader = make_pool(memory_budget=budget, max_loaded=max_loaded)
            with pytest.raises(OpenAIError, match="fill its share") as e:
                await full.lease("a")
            assert "--max-models-memory" in e.value.message and full_loader.events == []
            assert ("lower --max-loaded-models" in e.value.message) == (max_loaded > 1)  # (not when it is 1)

    run(main())


def test_a_model_that_loaded_once_loads_again_whatever_its_load_measured() -> None:
    """The price (size on disk and KV share) decides whether a model may load; what a load
    measured (resident growth, more than the file for expanded weights) decides only what
    makes room for it, at most the whole budget: it loads again, alone."""
    async def main():
        pool, loader = make_pool(memory_budget=400)
        (await pool.lease("a")).release()
        pool.models["a"].measured_bytes = 450  # grew more than the whole budget
        (await pool.lease("b")).release()  # "a" unloaded for it
        (await pool.lease("a")).release()
        assert loader.kv["a"] == 400 - 100 and pool.models["a"].reserved_bytes == 400
        return loader.events

    assert run(main()) == ["load a", "unload a", "load b", "unload b", "load a"]


def test_a_failed_loads_half_built_model_is_freed_before_the_answer() -> None:
    import gc
    import weakref

    class Weights:
        pass

    held: list[weakref.ref] = []

    async def load(spec: ModelSpec, kv: int | None) -> str:
        weights = Weights()
        weights.cycle = weights  # (freed only by a collection, as a module tree is)
        held.append(weakref.ref(weights))
        raise RuntimeError("out of memory")

    async def main():
        gc.disable()  # (no collection by chance: only the pool's own)
        try:
            pool = ModelPool([ModelSpec("a", "/models/a.gguf")], estimate=lambda spec: 100)
            pool.set_loader(load, Loader().unload)
            with pytest.raises(OpenAIError, match="RuntimeError") as e:
                await pool.lease("a")
            assert held[0]() is None and e.value.__context__ is None
        finally:
            gc.enable()

    run(main())


def test_an_unreadable_model_file_unloads_nothing_to_make_room(tmp_path) -> None:
    from pagedserve.model_loader.model_facts import weights_estimate

    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    (tmp_path / "bogus").mkdir()  # (a config of no family here: it unloaded "a" first, every try)
    (tmp_path / "bogus" / "config.json").write_text('{"model_type": "nonsense", "architectures": ["NopeForCausalLM"]}')
    loader = Loader()
    pool = ModelPool([ModelSpec("a", "/models/a.gguf"), ModelSpec("broken", str(tmp_path / "broken.gguf")),
                      ModelSpec("bogus", str(tmp_path / "bogus"))],
                     estimate=lambda spec: 100 if spec.name == "a" else weights_estimate(spec.source))
    pool.set_loader(loader.load, loader.unload)

    async def main():
        (await pool.lease("a")).release()
        for name in ("broken", "bogus"):
            with pytest.raises(OpenAIError, match="could not be loaded"):
                await pool.lease(name)
        assert pool.handlers("a") is not None

    run(main())
    assert loader.events == ["load a"]


def test_a_model_attached_at_start_whose_facts_are_unreadable_still_serves() -> None:
    def unreadable(spec: ModelSpec) -> int:
        raise ValueError("the files cannot be read as a model's")

    pool = ModelPool([ModelSpec("a", "/models/a")], estimate=unreadable)
    pool.attach("a", "handlers of a")  # (loaded by the engine's own loader: a start-up, not a failure)
    assert pool.handlers("a") == "handlers of a" and pool.models["a"].reserved_bytes == 0


def test_ps_shows_a_busy_models_expiry_as_its_keep_alive_from_now() -> None:
    import time

    async def main():
        pool, _ = make_pool(keep_alive=300.0)
        lease = await pool.lease("a")
        assert 290 < pool.expires_at_wall(pool.models["a"]) - time.time() <= 300  # not "forever"
        lease.release()
        kept = await pool.lease("b", keep_alive=None)
        assert pool.expires_at_wall(pool.models["b"]) is None
        kept.release()

    run(main())


def test_names_and_aliases_are_unique() -> None:
    with pytest.raises(ValueError, match="two models are served under the name 'a'"):
        ModelPool([ModelSpec("a", "x"), ModelSpec("b", "y", ("a",))])
    pool = ModelPool([ModelSpec("a", "x", ("alias",)), ModelSpec("b", "y")])
    assert pool.resolve(None) == "a" and pool.resolve("alias") == "a" and pool.resolve("/etc/passwd") is None


def test_a_models_dir_entry_tagged_latest_is_served_by_its_name_without_the_tag(tmp_path) -> None:
    """Ollama's routes read NAME:latest as NAME: a folder "weird:latest" was listed by
    /api/tags and /v1/models but answered 404 on every Ollama route."""
    from pagedserve.entrypoints.openai.model_sources import model_specs

    for name in ("weird:latest", "plain"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"")
    assert [s.name for s in model_specs(["smollm2-135m-instruct"], str(tmp_path), None)] == [
        "smollm2-135m-instruct", "m", "plain", "weird"]
    (tmp_path / "weird").mkdir()
    (tmp_path / "weird" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="under the name 'weird'"):
        ModelPool(model_specs([], str(tmp_path), None))
    # --served-model-name's names likewise (mine:latest was listed, and 404 on Ollama's routes)
    with pytest.raises(ValueError, match="--served-model-name 'mine:latest'.*name it 'mine'"):
        model_specs(["smollm2-135m-instruct"], None, ["alias", "mine:latest"])
    with pytest.raises(ValueError, match="--models-dir '' is not a directory"):  # (it was as if not given)
        model_specs(["smollm2-135m-instruct"], "", None)


def test_the_one_model_of_a_models_dir_is_named_by_its_file_not_its_path(tmp_path) -> None:
    """--models-dir's files are named by file or folder: with one model there, it was
    served as its path (the server's disk layout in /v1/models, the name a 404); a MODEL
    argument keeps its own spelling, and --served-model-name still names either."""
    from pagedserve.entrypoints.openai.model_sources import model_specs

    (tmp_path / "tiny.gguf").write_bytes(b"")
    [spec] = model_specs([], str(tmp_path), None)
    assert (spec.name, spec.source) == ("tiny", str(tmp_path / "tiny.gguf"))
    assert model_specs([], str(tmp_path), ["mine"])[0].name == "mine"
    assert model_specs([str(tmp_path / "tiny.gguf")], None, None)[0].name == str(tmp_path / "tiny.gguf")


def test_a_pool_that_cannot_load_keeps_its_model_whatever_keep_alive_asks_but_an_unload() -> None:
    """A one-model server (no loader): Ollama's default "5m" and any other keep_alive is met
    (the model stays loaded for good); only 0, an unload it could never undo, is refused."""
    pool = ModelPool([ModelSpec("only", "/models/only.gguf")], estimate=lambda spec: 100)
    pool.attach("only", "handlers of only")

    async def main() -> None:
        for keep_alive in (300.0, 0.5, None):
            lease = await pool.lease("only", keep_alive)
            assert lease.handlers == "handlers of only"
            lease.release()
        with pytest.raises(OpenAIError, match="keep_alive 0"):
            await pool.lease("only", 0)

    run(main())
    assert pool.models["only"].loaded == "handlers of only"


def test_two_models_that_fit_stay_loaded_together(monkeypatch) -> None:
    """Each load measured more than its file (the runtime's growth) and asked for the KV
    share as a ceiling its engine did not fill: counting that growth and the whole share
    made two models that fit together unload each other on every switch.  The pool counts
    the cache the engine sized."""
    from pagedserve.entrypoints.openai import model_pool

    rss = iter(range(0, 10_000, 150))  # every load grows the process by 150 (more than the 100 on disk)
    monkeypatch.setattr(model_pool, "rss_bytes", lambda pid: next(rss))
    sized = {"a": 50, "b": 60}  # what each engine's cache took of its 400 share

    async def main():
        pool, loader = make_pool(max_loaded=2, memory_budget=1000)
        pool.set_loader(loader.load, loader.unload, kv_bytes=lambda handlers: sized[handlers[-1]])
        for name in ("a", "b", "a", "b"):
            (await pool.lease(name)).release()
        assert loader.kv == {"a": 400, "b": 400}  # (the ceiling each engine was given)
        assert pool.models["a"].reserved_bytes == 150 + 50 and pool.models["b"].reserved_bytes == 150 + 60
        return loader.events

    assert run(main()) == ["load a", "load b"]


def test_two_models_that_each_take_their_whole_share_stay_loaded_together(monkeypatch) -> None:
    """Each engine filled its KV share (256 sequences of the model's whole context want
    more than any share), and each load grew the process past its file: counted whole,
    the two never fit and every switch unloaded the other."""
    from pagedserve.entrypoints.openai import model_pool

    rss = iter(range(0, 10_000, 150))  # every load grows the process by 150 (more than the 100 on disk)
    monkeypatch.setattr(model_pool, "rss_bytes", lambda pid: next(rss))

    async def main():
        pool, loader = make_pool(max_loaded=2, memory_budget=1000)
        pool.set_loader(loader.load, loader.unload, kv_bytes=lambda handlers: 400)  # the whole share
        for name in ("a", "b", "a", "b"):
            (await pool.lease(name)).release()
        assert pool.models["a"].reserved_bytes == pool.models["b"].reserved_bytes == 500  # its share of 1000
        return loader.events

    assert run(main()) == ["load a", "load b"]


def test_a_loaded_models_kv_cache_is_read_off_its_engines_description() -> None:
    """What the server's loader tells the pool (ModelHandlers.kv_cache_bytes): blocks x
    block size x bytes per token on every tensor-parallel rank and data-parallel replica."""
    from types import SimpleNamespace

    from pagedserve.entrypoints.openai.server_state import ModelHandlers

    def kv(description: dict) -> int | None:
        return ModelHandlers.kv_cache_bytes.fget(SimpleNamespace(attachment=SimpleNamespace(description=description)))

    one = {"num_blocks": 128, "block_size": 16, "kv_bytes_per_token": "23040"}
    assert kv(one) == 128 * 16 * 23040
    assert kv({**one, "tensor_parallel_size": "2", "data_parallel_size": 3}) == 6 * 128 * 16 * 23040
    assert kv({}) is None and kv({**one, "num_blocks": None}) is None


def test_a_request_waiting_for_a_load_counts_as_leased_through_a_close() -> None:
    """A drain waits for `leased`: a request accepted before the signal but waiting for
    its model's load has no engine request yet (it was cut after 5 s); the load under
    way finishes after close() and the request is served."""
    async def main():
        pool, loader = make_pool(loader=Loader(delay=0.1))
        waiting = asyncio.ensure_future(pool.lease("b"))
        await asyncio.sleep(0.02)
        during = pool.leased
        pool.close()
        lease = await waiting
        held = pool.leased
        lease.release()
        return during, held, lease.handlers, pool.leased

    assert run(main()) == (1, 1, "handlers of b", 0)


def test_a_load_nobody_waits_for_any_more_unloads_nothing_and_holds_up_no_one() -> None:
    """The requests for a model waiting for room all go (hung up, timed out): its load
    gives up, so the busy model is not unloaded for it and new requests for that model
    are served at once instead of waiting their turn behind it."""
    async def main():
        pool, loader = make_pool()
        busy = await pool.lease("a")
        b = asyncio.ensure_future(pool.lease("b"))  # waits for "a" to go idle
        await asyncio.sleep(0.05)
        b.cancel()  # its client hung up
        await asyncio.sleep(0.05)
        (await asyncio.wait_for(pool.lease("a"), 1)).release()  # not behind b's abandoned load
        busy.release()
        await asyncio.sleep(0.05)
        assert pool.handlers("a") is not None and pool.handlers("b") is None
        (await asyncio.wait_for(pool.lease("b"), 5)).release()  # a later request for b loads it
        return loader.events

    assert run(main()) == ["load a", "unload a", "load b"]


def test_a_model_whose_config_refuses_the_servers_flags_unloads_nothing(tmp_path) -> None:
    """A --max-model-len past one model's limit, or a directory without its weight files,
    fails that model's load before the loaded model is unloaded for it (it was unloaded,
    the load failed, and it loaded again)."""
    import json

    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.entrypoints.openai.model_sources import check_model_config

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 64,
        "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 32,
        "vocab_size": 100}))
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weight files"):
        check_model_config(EngineArgs(model=str(tmp_path)), ModelSpec("short", str(tmp_path)))
    (tmp_path / "model.safetensors").touch()
    assert check_model_config(EngineArgs(model=str(tmp_path)), ModelSpec("short", str(tmp_path))) == 64
    check = functools.partial(check_model_config, EngineArgs(model=str(tmp_path), max_model_len=128))

    async def main():
        loader = Loader()
        pool = ModelPool([ModelSpec("a", "/models/a.gguf"), ModelSpec("short", str(tmp_path))],
                         estimate=lambda spec: 100, check=lambda spec: check(spec) if spec.name == "short" else None)
        pool.set_loader(loader.load, loader.unload)
        (await pool.lease("a")).release()
        with pytest.raises(OpenAIError, match="'short' could not be loaded") as e:
            await pool.lease("short")
        assert e.value.status == 500 and pool.handlers("a") is not None
        return loader.events

    assert run(main()) == ["load a"]


def test_a_request_arriving_as_an_abandoned_load_gives_up_starts_its_own(monkeypatch) -> None:
    """The abandoned load's task is done but its callback has not yet cleared `loading`:
    a new request awaited that done task again and again (Python 3.12's wait_for does not
    yield on a done future, so the server froze); it starts a load of its own instead."""
    from types import SimpleNamespace

    from pagedserve.entrypoints.openai import model_pool

    calls = [0]

    async def wait_for(future, timeout):  # Python 3.12's: no turn of the loop for a done future
        calls[0] += 1
        assert calls[0] < 1000, "spinning on a done load"
        async with asyncio.timeout(timeout):
            return await future

    patched = {n: getattr(asyncio, n) for n in dir(asyncio) if not n.startswith("_")}
    monkeypatch.setattr(model_pool, "asyncio", SimpleNamespace(**{**patched, "wait_for": wait_for}))

    async def main():
        pool, loader = make_pool()
        async with pool._lock:  # another load holds the lock
            first = asyncio.ensure_future(pool.lease("b"))
            await asyncio.sleep(0.01)  # its load waits for the lock
            first.cancel()
            await asyncio.wait({first})
        second = asyncio.ensure_future(pool.lease("b"))  # runs right after the abandoned load's last step
        (await asyncio.wait_for(second, 5)).release()
        return loader.events

    assert run(main()) == ["load b"]


def test_the_pools_flags_say_they_do_nothing_for_one_model(caplog) -> None:
    """--keep-alive, --max-loaded-models and --max-models-memory only act when several models
    are served: with one, each set is named in a warning (they changed nothing, silently)."""
    import argparse
    import logging

    from pagedserve.entrypoints.openai.api_server import make_arg_parser
    from pagedserve.entrypoints.openai.model_sources import pool_options

    parser = make_arg_parser(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["m", "--keep-alive", "1s", "--max-loaded-models", "3"])
    with caplog.at_level(logging.WARNING, logger="pagedserve.api_server"):
        pool_options(args, 1, "cpu")
        warned = caplog.text
        caplog.clear()
        pool_options(parser.parse_args(["m"]), 1, "cpu")
    assert "--keep-alive has no effect" in warned and "--max-loaded-models has no effect" in warned
    assert "--max-models-memory" not in warned and not caplog.text
