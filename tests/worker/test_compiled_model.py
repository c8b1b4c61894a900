"""When the model is compiled, when it is not, and what a failed compile leaves behind."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.engine.arg_utils import EngineArgs, env_torch_compile
from pagedserve.worker.compiled_model import CompiledModel, maybe_compile
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
        assert env_torch_compile() is want
        assert EngineArgs().create_engine_config(load_hf_config=False).device_config.torch_compile is want
    monkeypatch.setenv("PAGEDSERVE_TORCH_COMPILE", "maybe")
    with pytest.raises(ValueError, match="PAGEDSERVE_TORCH_COMPILE must be 0 or 1"):
        env_torch_compile()
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
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    outputs = []
    for extra in ({"ATEN_CPU_CAPABILITY": "avx2"}, {}):
        run = subprocess.run([sys.executable, "-c", _CHILD], env={**env, **extra},
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.append(run.stdout.strip().splitlines()[-1])
    assert outputs[0] == outputs[1]
