"""`python -m tests.entrypoints.openai.faulty_server serve ...`: the real server whose
engine step raises after $FAULT_AFTER_STEPS steps (a stand-in for a kernel or device
failure), for the engine-failure test; and whose every step takes at least
$STEP_DELAY_S seconds where set, so that a test's request is still running when it
looks (the lifecycle tests: a tiny model's 200 tokens took ~0.3 s on a Zen 5 with AVX-512, less than
the test's own steps)."""

from __future__ import annotations

import os
import time

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.cli import main

_real_step = LLMEngine.step
_steps = [0]


def _step(self: LLMEngine):
    _steps[0] += 1
    if "FAULT_AFTER_STEPS" in os.environ and _steps[0] > int(os.environ["FAULT_AFTER_STEPS"]):
        raise RuntimeError("injected fault in /some/kernel/path.cpp")
    if "STEP_DELAY_S" in os.environ:
        time.sleep(float(os.environ["STEP_DELAY_S"]))
    return _real_step(self)


LLMEngine.step = _step  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
