"""Building the C++ kernels survives a build that died half-way (the CI hang of a
process that exited while its background build held torch's lock marker)."""

from __future__ import annotations

import shutil

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


def test_each_virtual_environment_gets_its_own_build_directory(monkeypatch) -> None:
    """Two environments with the same torch version share the cache root, but torch writes
    each one's include paths into the build command: one directory each, so neither
    rebuilds over the other's."""
    import torch

    source = SOURCE
    here, again = extension_build_dir("k", source), extension_build_dir("k", source)
    assert here == again  # stable within one environment
    monkeypatch.setattr(torch, "__file__", "/other/venv/lib/python3.11/site-packages/torch/__init__.py")
    other = extension_build_dir("k", source)
    assert other[0] != here[0] and other[1] != here[1] and other[2] == here[2]
    monkeypatch.setenv("CXX", "clang++")
    assert extension_build_dir("k", source)[0] not in (here[0], other[0])
