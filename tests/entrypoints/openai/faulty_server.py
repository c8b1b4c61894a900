"""`python -m tests.entrypoints.openai.faulty_server serve ...`: the real server whose
engine step raises after $FAULT_AFTER_STEPS steps (a stand-in for a kernel or device
failure), for the engine-failure test."""

from __future__ import annotations

import os

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.cli import main

_real_step = LLMEngine.step
_steps = [0]


def _failing_step(self: LLMEngine):
    _steps[0] += 1
    if _steps[0] > int(os.environ["FAULT_AFTER_STEPS"]):
        raise RuntimeError("injected fault in /some/kernel/path.cpp")
    return _real_step(self)


LLMEngine.step = _failing_step  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
