"""The kernel builds the tests compare (native, AVX2, plain loops), and which of them are
one module on this CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

import pagedserve
from pagedserve.cpu_extension import extension_build_dir

AVX2_TEST_BUILD = ("-mno-avx512f",)


def _module_name(cflags: tuple[str, ...] | None) -> str:
    return extension_build_dir("probe", Path(pagedserve.__file__), cflags)[0]


# Without AVX-512 (a Zen 3, most laptops; or torch capped to AVX2) "-mno-avx512f" changes
# nothing: the AVX2 build is the native build (pagedserve.cpu_extension gives both one name),
# so its tests would run the very module the native ones just ran, compile-free but twice.
AVX2_IS_NATIVE = _module_name(None) == _module_name(AVX2_TEST_BUILD)
SAME_AS_NATIVE = pytest.mark.skipif(AVX2_IS_NATIVE, reason="the AVX2 build is this CPU's native build: tested as that")


def avx2_param(value: object) -> object:
    """`value` as a parameter that stands for the AVX2 build: skipped where that is the native one."""
    return pytest.param(value, marks=SAME_AS_NATIVE, id="avx2")
