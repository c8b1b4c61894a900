"""A module imported on its first attribute access, for test files whose heavy client
libraries only their own tests use.  Every pytest-xdist worker imports every test file
at collection, so a module-level `import anthropic` cost each worker 1.1 s (ray 0.5 s,
torch._dynamo 0.8 s; Zen 5, AVX-512 with native bf16) even when the file's tests ran on
the other one; behind this, only the worker running them pays."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for module `name`; the first read of a public attribute imports it.  Private
    and dunder names are not forwarded: pytest's collection probes every module-level
    object for them (`__test__`, `_pytestfixturefunction`, ...)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)
