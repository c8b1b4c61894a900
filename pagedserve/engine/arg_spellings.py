"""vLLM's spellings of engine arguments, as scripts written for its `LLM(...)` pass them,
in this engine's terms (EngineArgs.from_kwargs takes them through here)."""

from __future__ import annotations

from typing import Any

# vLLM's `task` (before its `runner`): the runner each one takes.
_TASK_RUNNERS = {"auto": None, "generate": "generate", "embed": "pooling", "encode": "pooling",
                 "classify": "pooling", "score": "pooling", "reward": "pooling"}


def vllm_spellings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What scripts written for vLLM's `LLM(...)` pass, in this engine's terms: `task`
    as the runner it names, `seed=None` as a random engine seed, `quantization=None` as
    "auto" (both vLLM's defaults)."""
    kwargs = dict(kwargs)
    if "task" in kwargs:
        task = kwargs.pop("task")
        if task not in _TASK_RUNNERS:
            raise ValueError(f"task must be one of {', '.join(_TASK_RUNNERS)} (vLLM's; here: runner="
                             f"'generate' or 'pooling'), got {task!r:.100}")
        runner = _TASK_RUNNERS[task]
        if runner is not None and kwargs.setdefault("runner", runner) != runner:
            raise ValueError(f"task={task!r} asks for runner={runner!r}, but runner={kwargs['runner']!r} was given")
    if "seed" in kwargs and kwargs["seed"] is None:
        import secrets

        kwargs["seed"] = secrets.randbits(31)
    if "quantization" in kwargs and kwargs["quantization"] is None:
        kwargs["quantization"] = "auto"
    return kwargs
