"""When the model is compiled, when it is not, and what a failed compile leaves behind."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve import envs
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.forward_context import set_forward_context
from pagedserve.worker import compiled_model
from pagedserve.worker.compiled_model import CompiledModel, artifact_key, load_artifact, maybe_compile
from tests.worker.worker_helpers import ToyModel

CPU = torch.device("cpu")


def test_explicit_request_is_refused_where_it_cannot_apply():
    model = ToyModel()
    with pytest.raises(ValueError, match="CPU only"):
        maybe_compile(model, torch.device("cuda"), True, False, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        maybe_compile(model, CPU, True, False, 2)
    # By default it is simply off there.
    assert maybe_compile(model, torch.device("cuda"), None, False, 1) is None
    assert maybe_compile(model, CPU, None, False, 2) is None


def test_off_when_asked_or_eager():
    model = ToyModel()
    assert maybe_compile(model, CPU, False, False, 1) is None
    assert maybe_compile(model, CPU, None, True, 1) is None


def test_a_failed_compile_leaves_the_eager_model(monkeypatch, caplog):
    def boom(self, input_ids, positions):
        raise RuntimeError("inductor: unsupported op\nmore detail")

    monkeypatch.setattr(CompiledModel, "warm_up", boom)
    model = ToyModel()
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        assert maybe_compile(model, CPU, True, False, 1) is None
    assert "torch.compile failed, running eagerly (RuntimeError: inductor: unsupported op)" in caplog.text
    assert all(getattr(m, "opaque_index", None) is None for m in model.modules())


def test_engine_args():
    with pytest.raises(ValueError, match="contradicts enforce_eager"):
        EngineArgs(torch_compile=True, enforce_eager=True)
    with pytest.raises(ValueError, match="torch_compile must be"):
        EngineArgs(torch_compile="yes")


def test_environment_default(monkeypatch):
    for value, want in (("1", True), ("off", False), ("", None)):
        monkeypatch.setenv("PAGEDSERVE_TORCH_COMPILE", value)
        assert envs.torch_compile() is want
        assert EngineArgs().create_engine_config(load_hf_config=False).device_config.torch_compile is want
    monkeypatch.setenv("PAGEDSERVE_TORCH_COMPILE", "maybe")
    with pytest.raises(ValueError, match="PAGEDSERVE_TORCH_COMPILE must be 0 or 1"):
        envs.torch_compile()
    # An explicit argument wins over the environment.
    monkeypatch.setenv("PAGEDSERVE_TORCH_COMPILE", "1")
    cfg = EngineArgs(torch_compile=False).create_engine_config(load_hf_config=False)
    assert cfg.device_config.torch_compile is False


_CHILD = """
import torch
from pagedserve.forward_context import set_forward_context
from pagedserve.worker.compiled_model import maybe_compile
from tests.worker.worker_helpers import ToyModel
model = ToyModel(layers=1)
compiled = maybe_compile(model, torch.device("cpu"), True, False, 1)
ids = torch.arange(7)
with torch.inference_mode(), set_forward_context(None):
    print(model.compute_logits(compiled(ids, ids)).argmax(-1).tolist())
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="needs an AVX-512 CPU: elsewhere the emulated AVX2 capability is the default one")
def test_a_graph_cached_under_another_cpu_capability_is_not_reused(tmp_path):
    """Compiling under ATEN_CPU_CAPABILITY=avx2 then loading that cache in a default
    process crashed with heap corruption ("malloc(): unaligned tcache chunk detected",
    with this toy model too) before the cache was keyed by vector width."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PAGEDSERVE_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    outputs = []
    for extra in ({"ATEN_CPU_CAPABILITY": "avx2"}, {}):
        run = subprocess.run([sys.executable, "-c", _CHILD], env={**env, **extra},
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.append(run.stdout.strip().splitlines()[-1])
    assert outputs[0] == outputs[1]


def test_a_saved_compilation_is_loaded_by_the_next_model_with_its_own_weights(tmp_path, monkeypatch, caplog):
    """The first compile saves the forward; a second model of the same shape (other
    weights) loads it instead of tracing, and computes with its own weights; a changed
    source or a torn file is a miss, never a failure."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    first = maybe_compile(ToyModel(layers=1), CPU, True, False, 1)
    assert first is not None and first.guard_free and first.loaded_from is None
    [saved] = (tmp_path / "compiled").iterdir()
    model = ToyModel(layers=1, seed=1)
    second = maybe_compile(model, CPU, True, False, 1)
    assert second is not None and second.guard_free and second.loaded_from == str(saved)
    ids = torch.arange(7)
    with torch.inference_mode(), set_forward_context(None):
        torch.testing.assert_close(second(ids, ids), model(ids, ids), rtol=1e-5, atol=1e-5)
        # 1 token: the saved graph is dynamic in the token count, as the traced one is
        torch.testing.assert_close(second(ids[:1], ids[:1]), model(ids[:1], ids[:1]), rtol=1e-5, atol=1e-5)

    with caplog.at_level(logging.INFO, logger="pagedserve"):
        real = compiled_model._source_sums
        monkeypatch.setattr(compiled_model, "_source_sums", lambda names: {n: "edited" for n in real(names)})
        assert load_artifact(str(saved)) is None
        assert "sources changed since" in caplog.text
        monkeypatch.undo()
        saved.write_bytes(saved.read_bytes()[:200])
        assert load_artifact(str(saved)) is None
        assert "could not load" in caplog.text


def test_the_saved_compilation_key_covers_what_a_trace_bakes_in():
    """Weights are the graph's inputs: not in the key.  Module attributes are constants in
    the graph (a sliding window, a head count): in the key.  The KV cache a layer is bound
    to after sizing never enters the graph: not in the key; nor does the path a Hugging
    Face config was read from (a copy of a model loads the first one's compilation)."""
    base = artifact_key(ToyModel(layers=1))
    assert artifact_key(ToyModel(layers=1, seed=3)) == base
    assert artifact_key(ToyModel(layers=1, window=8)) != base
    assert artifact_key(ToyModel(layers=1, heads=8, kv_heads=4, head_dim=8)) != base
    assert artifact_key(ToyModel(layers=2)) != base
    bound = ToyModel(layers=1)
    bound.layers[0].attn.kv_cache = (torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))
    assert artifact_key(bound) == base
    from transformers import LlamaConfig

    configured = []
    for path in ("/models/a", "/elsewhere/b"):
        model = ToyModel(layers=1)
        model.config = LlamaConfig(num_hidden_layers=1, name_or_path=path)
        configured.append(artifact_key(model))
    assert configured[0] == configured[1] != base
    model.config.rms_norm_eps = 1e-3  # a value the forward reads
    assert artifact_key(model) != configured[0]
    from pagedserve.model_loader.config_snapshot import ConfigSnapshot

    snapped = []
    for path in ("/models/a", "/elsewhere/b"):  # a saved config keeps the path as name_or_path
        model = ToyModel(layers=1)
        model.config = ConfigSnapshot({"name_or_path": path, "num_hidden_layers": 1})
        snapped.append(artifact_key(model))
    assert snapped[0] == snapped[1] != base


def test_inductor_kernels_run_serially_up_to_two_threads_and_the_key_says_so():
    """Up to SERIAL_KERNELS_MAX_THREADS threads the fused kernels are generated without an
    OpenMP region; the thread count they were generated for is part of the saved
    compilation's key, so a process with more threads compiles its own."""
    from pagedserve.worker.compiled_model import SERIAL_KERNELS_MAX_THREADS, inductor_options

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(SERIAL_KERNELS_MAX_THREADS)
        assert inductor_options()["cpp.threads"] == 1
        serial = artifact_key(ToyModel(layers=1))
        torch.set_num_threads(SERIAL_KERNELS_MAX_THREADS + 1)
        assert "cpp.threads" not in inductor_options()
        assert artifact_key(ToyModel(layers=1)) != serial
    finally:
        torch.set_num_threads(before)


def test_triton_is_hidden_while_a_cpu_model_compiles_and_importable_after(monkeypatch):
    """torch._dynamo imports Triton only to note its version, which CPU compilations never
    read: while a CPU model compiles `import triton` fails, afterwards it works again; a
    process that already imported it keeps its module."""
    import sys
    import types

    seen: list[object] = []

    def probe(self, input_ids, positions):
        seen.append(sys.modules.get("triton", "absent"))
        return 0.0

    monkeypatch.setattr(CompiledModel, "warm_up", probe)
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    assert maybe_compile(ToyModel(), CPU, True, False, 1) is not None
    assert seen == [None]
    assert "triton" not in sys.modules
    imported = types.ModuleType("triton")
    monkeypatch.setitem(sys.modules, "triton", imported)
    assert maybe_compile(ToyModel(), CPU, True, False, 1) is not None
    assert seen == [None, imported] and sys.modules["triton"] is imported


def test_whether_triton_is_installed_is_read_from_the_path_not_from_a_hidden_import(monkeypatch):
    """fused_ops keeps its answer for the process: asked while a CPU compile hides Triton
    (a test forcing the fused kernels on CPU tensors), it must still say what is installed."""
    import sys

    from pagedserve.layers import fused_ops

    fused_ops._triton_installed.cache_clear()
    try:
        installed = fused_ops._triton_installed()
        fused_ops._triton_installed.cache_clear()
        monkeypatch.setitem(sys.modules, "triton", None)
        assert fused_ops._triton_installed() == installed
    finally:
        fused_ops._triton_installed.cache_clear()


@pytest.mark.parametrize("arch, dtype", [("llama", "bfloat16"), ("llama", "float32"), ("gemma3", "float32")])
def test_not_by_default_where_every_layer_runs_direct_fused_calls(arch, dtype, tmp_path, monkeypatch, caplog):
    """A quantized Llama's or Gemma 3's layers all bind direct calls to the fused C++
    kernels, in bf16 and in float32 (the default where the CPU has no native bf16), as
    fast as a compiled graph: by default the runner does not compile it."""
    from pagedserve.layers import cpu_fused
    from pagedserve.models.utils import DirectBindable
    from pagedserve.worker.model_runner import ModelRunner
    from tests.e2e.conftest import make_tiny_checkpoint

    if cpu_fused.fused_kernel_error() is not None:
        pytest.skip(f"no C++ toolchain here: {cpu_fused.fused_kernel_error()}")
    monkeypatch.delenv("PAGEDSERVE_TORCH_COMPILE", raising=False)  # (the suite sets 0)
    calls: list[object] = []
    monkeypatch.setattr("pagedserve.worker.model_runner.maybe_compile",
                        lambda model, device, requested, *args: calls.append(requested))
    make_tiny_checkpoint(arch, str(tmp_path))
    config = EngineArgs(model=str(tmp_path), dtype=dtype, quantization="int8", max_model_len=64,
                        num_gpu_blocks_override=16, torch_compile=None).create_engine_config()
    from pagedserve.model_loader import get_model

    model = get_model(config.model_config, "cpu")
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        ModelRunner(config, model, CPU).initialize_kv_cache()
    assert calls == [False]
    assert "torch.compile: not by default" in caplog.text
    layers = [m for m in model.modules() if isinstance(m, DirectBindable)]
    assert layers and all(layer.direct is not None for layer in layers)
