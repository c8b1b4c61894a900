"""Building the C++ kernels survives a build that died half-way (the CI hang of a
process that exited while its background build held torch's lock marker); a process
builds each kernel once and remembers a failed build."""

from __future__ import annotations

import shutil
import types

import pytest

from pagedserve.attention.cpu_paged import SOURCE
from pagedserve.cpu_extension import build_cpu_extension, extension_build_dir

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.timeout(600)  # the bug this guards against was a wait without end
def test_a_lock_marker_left_by_a_killed_build_does_not_block_the_next() -> None:
    name, build_dir, _ = extension_build_dir("pagedserve_paged_decode", SOURCE)
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").touch()  # what torch leaves when its builder is killed mid-build
    module = build_cpu_extension("pagedserve_paged_decode", SOURCE, "CPU decode-attention kernel")
    assert module.__name__ == name and callable(module.paged_decode)
    assert not (build_dir / "lock").exists()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_environments_with_the_same_torch_and_python_share_one_build(monkeypatch) -> None:
    """A fresh virtual environment (CI's, every run) finds the build another one made:
    same directory, imported without torch's builder, whose ninja file names the other
    environment's include paths and would rebuild.  Another compiler gets its own."""
    import torch
    from torch.utils import cpp_extension

    here = extension_build_dir("pagedserve_paged_decode", SOURCE)
    build_cpu_extension("pagedserve_paged_decode", SOURCE, "CPU decode-attention kernel")  # built (or cached)
    monkeypatch.setattr(torch, "__file__", "/other/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert extension_build_dir("pagedserve_paged_decode", SOURCE) == here

    def no_builder(**kwargs):
        raise AssertionError("a finished build went through torch's builder")

    monkeypatch.setattr(cpp_extension, "load", no_builder)
    module = build_cpu_extension("pagedserve_paged_decode", SOURCE, "CPU decode-attention kernel")
    assert module.__name__ == here[0] and callable(module.paged_decode)
    monkeypatch.setenv("CXX", "clang++")
    assert extension_build_dir("pagedserve_paged_decode", SOURCE)[0] != here[0]


def test_the_build_name_does_not_read_sysconfig(monkeypatch) -> None:
    """The kernels build on a background thread while the main thread imports; sysconfig's
    first read fills a shared dict, and a build that read it half-filled got a second name
    for the same build (a rebuild, and a saved compiled model calling operators by the
    other name).  The name must not depend on what sysconfig answers."""
    import sysconfig

    name = extension_build_dir("pagedserve_paged_decode", SOURCE)[0]
    monkeypatch.setattr(sysconfig, "get_config_var", lambda *a, **k: None)
    monkeypatch.setattr(sysconfig, "get_config_vars", lambda *a, **k: {})
    assert extension_build_dir("pagedserve_paged_decode", SOURCE)[0] == name


def test_the_build_root_is_torchs_default_without_importing_its_builder(monkeypatch) -> None:
    """Our build root is torch's extension root (builds made through its builder are
    found), computed without importing torch.utils.cpp_extension, which pulls in setuptools."""
    import sys

    from torch.utils import cpp_extension

    from pagedserve.cpu_extension import default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert default_build_root() == cpp_extension.get_default_build_root()
    monkeypatch.delitem(sys.modules, "torch.utils.cpp_extension")
    _, build_dir, _ = extension_build_dir("pagedserve_paged_decode", SOURCE)
    assert str(build_dir.parent) == default_build_root()
    assert "torch.utils.cpp_extension" not in sys.modules


def test_a_kernel_is_built_once_and_a_failed_build_is_not_retried(monkeypatch, tmp_path):
    from pagedserve import cpu_extension

    calls: list[str] = []
    loaded: list[object] = []

    def fake_build(prefix, source, what, extra_cflags=None):
        calls.append(prefix)
        if prefix == "broken":
            raise RuntimeError("compile failed\nc++: not found")
        return types.SimpleNamespace(name=prefix)

    monkeypatch.setattr(cpu_extension, "build_cpu_extension", fake_build)
    good = cpu_extension.CpuKernel("good", tmp_path / "k.cpp", "test kernel", "test phase", on_load=loaded.append)
    assert good.error() is None and good.get() is good.get()
    assert calls == ["good"] and len(loaded) == 1
    broken = cpu_extension.CpuKernel("broken", tmp_path / "k.cpp", "broken kernel", "test phase")
    assert broken.error() == "RuntimeError: c++: not found"
    with pytest.raises(RuntimeError, match="did not build in this process .RuntimeError: c..: not found"):
        broken.get()
    assert broken.error() == "RuntimeError: c++: not found"
    assert calls == ["good", "broken"]
