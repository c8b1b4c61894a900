"""vLLM's spellings of engine arguments, as scripts written for its `LLM(...)` pass them,
in this engine's terms (EngineArgs.from_kwargs takes them through here)."""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from pagedserve.utils import same_value

logger = logging.getLogger("pagedserve")
_warned: set[str] = set()  # (a CLI run reads its flags more than once: each warning said once)

# vLLM's `task` (before its `runner`): the runner each one takes.
_TASK_RUNNERS = {"auto": None, "generate": "generate", "embed": "pooling", "encode": "pooling",
                 "classify": "pooling", "score": "pooling", "reward": "pooling"}


# vLLM's arguments this engine has no field for: the values that ask for what it does
# anyway (dropped), and what any other value asks for (refused by name).
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "disable_log_stats": ((True, None), "an offline LLM logs no periodic stats here (the server logs them)"),
    "tokenizer_mode": (("auto", "hf", None), "the model's fast (Hugging Face) tokenizer is the only mode here"),
    "cpu_offload_gb": ((None, 0), "weights are not offloaded here"),
    "revision": ((None, "main"), "models come from local files (no hub downloads)"),
    "code_revision": ((None,), "models come from local files (no hub downloads)"),
    "tokenizer_revision": ((None,), "models come from local files (no hub downloads)"),
    "download_dir": ((None,), "models come from local files (no hub downloads)"),
    "hf_token": ((None,), "models come from local files (no hub downloads)"),
    "hf_overrides": ((None, {}), "the model's config is read as it is"),
    "disable_custom_all_reduce": ((True, False, None), ""),  # (no custom all-reduce either way)
    "enable_sleep_mode": ((False, None), "there is no sleep mode (LLM.sleep) here"),
    "pipeline_parallel_size": ((1, None), "no pipeline parallelism here (tensor_parallel_size splits the model)"),
    "skip_tokenizer_init": ((False, None), "prompts, stop strings and answers' text need the tokenizer here"),
    "logprobs_mode": (("raw_logprobs", None), "logprobs are the raw model's (before penalties and temperature), "
                                              "vLLM's default raw_logprobs"),
    "mm_processor_kwargs": ((None, {}), "images are processed with the model's own processor settings"),
}


def json_argument(text: str) -> Any:
    """A flag's JSON value (argparse names the flag; json.loads's own name said "invalid loads value")."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r:.80} is not JSON ({e.msg})") from None


def _int_or_json(text: str) -> Any:
    """vLLM's -O / --compilation-config: a level ("3") or a JSON object."""
    return int(text) if text.strip().lstrip("-").isdigit() else json_argument(text)


# vLLM's command-line flags for the arguments above and those _config_spellings maps,
# each read as vLLM's command line reads it (None: a flag without a value):
# EngineArgs.add_cli_args adds them, and from_cli_args takes what was given through
# vllm_spellings, as LLM(...)'s keywords are, so the command line and LLM(...) agree.
VLLM_FLAGS: dict[str, tuple[tuple[str, ...], Callable[[str], Any] | None]] = {
    **{name: ((), str) for name in ("tokenizer_mode", "revision", "code_revision", "tokenizer_revision",
                                    "download_dir", "hf_token", "distributed_executor_backend", "task",
                                    "logprobs_mode")},
    **{name: ((), json_argument) for name in ("hf_overrides", "structured_outputs_config", "mm_processor_kwargs")},
    **{name: ((), None) for name in ("disable_custom_all_reduce", "enable_sleep_mode", "skip_tokenizer_init")},
    "cpu_offload_gb": ((), float), "swap_space": ((), float), "pipeline_parallel_size": (("-pp",), int),
    "compilation_config": (("-O",), _int_or_json),
}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """VLLM_FLAGS on `parser`, in their own group of --help."""
    group = parser.add_argument_group("vLLM's arguments", "taken where they ask for what this engine does, "
                                      "mapped to its own, or refused with the reason")
    for name, (aliases, kind) in VLLM_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if kind is None:
            group.add_argument(flag, *aliases, action="store_true", default=None)
        else:
            group.add_argument(flag, *aliases, type=kind, default=None, metavar=name.split("_")[-1].upper())


def vllm_flags_given(ns: argparse.Namespace) -> dict[str, Any]:
    """The VLLM_FLAGS a command line set, as keywords for vllm_spellings."""
    return {name: getattr(ns, name) for name in VLLM_FLAGS if getattr(ns, name, None) is not None}


# vLLM's torch.compile levels (compilation_config=N or {"level": N} / {"mode": N}): 0 is
# eager, 1 and 2 compile, 3 (vLLM v1's default, its -O3) asks for the default.
_COMPILE_KEYS = ("level", "mode")


def _compile_spelling(value: Any) -> bool | None:
    """torch_compile for vLLM's compilation_config (None: the default)."""
    if value is None or value == {}:
        return None
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in _COMPILE_KEYS:
        value = next(iter(value.values()))
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return None if value == 3 else value > 0
    raise ValueError(f"compilation_config={value!r:.80} is not supported here: a level 0-3 (0: eager, 1 and 2: "
                     "torch.compile, 3: the default) alone, or its torch_compile=True/False and enforce_eager")


# Arguments whose values are credentials: named in an error, never shown.
_SECRETS = frozenset({"hf_token"})


def vllm_spellings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What scripts written for vLLM's `LLM(...)` pass, in this engine's terms: `task`
    as the runner it names, `seed=None` as a random engine seed, `quantization=None` as
    "auto" (both vLLM's defaults), `swap_space=N` (GiB of host memory a preempted
    request's KV is swapped to) as kv_offload_bytes where preemption_mode is "swap" (else
    without effect, as in vLLM v1, which swaps nothing: named in a warning),
    `structured_outputs_config={"backend": ...}` (and
    `guided_decoding_backend`) as structured_outputs_backend, `compilation_config` as
    torch_compile, `distributed_executor_backend` as the executor it names, a torch.dtype
    `dtype` as its name, and its other
    arguments at a value asking for nothing (`_NEUTRAL`) dropped, at any other refused."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in VLLM_FLAGS}  # (an unset flag's None)
    for name in [k for k in kwargs if k in _NEUTRAL]:
        value, (neutral, why) = kwargs.pop(name), _NEUTRAL[name]
        if not (value is None and None in neutral or same_value(value, neutral)):
            shown = "..." if name in _SECRETS else f"{value!r:.60}"  # (an error line is printed and logged)
            raise ValueError(f"{name}={shown} is not supported here: {why}")
    _config_spellings(kwargs)
    if "task" in kwargs:
        task = kwargs.pop("task")
        if task not in _TASK_RUNNERS:
            raise ValueError(f"task must be one of {', '.join(_TASK_RUNNERS)} (vLLM's; here: runner="
                             f"'generate' or 'pooling'), got {task!r:.100}")
        if _TASK_RUNNERS[task] is not None:
            _take(kwargs, "runner", _TASK_RUNNERS[task], f"task={task!r}")
    if "seed" in kwargs and kwargs["seed"] is None:
        import secrets

        kwargs["seed"] = secrets.randbits(31)
    if "quantization" in kwargs and kwargs["quantization"] is None:
        kwargs["quantization"] = "auto"
    dtype = kwargs.get("dtype")
    if dtype is not None and not isinstance(dtype, str) and str(dtype).startswith("torch."):
        kwargs["dtype"] = str(dtype).removeprefix("torch.")  # (vLLM takes a torch.dtype too)
    return kwargs


def _take(kwargs: dict[str, Any], name: str, value: Any, spelling: str) -> None:
    """kwargs[name] = value, where vLLM's `spelling` asks for it; the same field given
    otherwise too must agree (the engine's own name won in silence)."""
    given = kwargs.setdefault(name, value)
    if given is not None and given != value:
        raise ValueError(f"{spelling} asks for {name}={value!r}, but {name}={given!r} was given too")


def _config_spellings(kwargs: dict[str, Any]) -> None:
    """vLLM's swap_space, structured_outputs_config, guided_decoding_backend,
    compilation_config and distributed_executor_backend as this engine's fields (in place)."""
    swap = kwargs.pop("swap_space", None)
    if swap is not None and (isinstance(swap, bool) or not isinstance(swap, (int, float))
                             or not (swap >= 0 and math.isfinite(swap))):  # (inf failed in int(), unnamed)
        raise ValueError(f"swap_space must be a finite number of GiB >= 0, got {swap!r:.40}")
    if swap and kwargs.get("preemption_mode") == "swap":
        kwargs.setdefault("kv_offload_bytes", int(swap * 2**30))
    elif swap and "swap_space" not in _warned:  # (it was dropped in silence)
        _warned.add("swap_space")
        logger.warning("swap_space (--swap-space) has no effect without preemption_mode='swap' "
                       "(--preemption-mode swap): a preempted request is recomputed")
    config = kwargs.pop("structured_outputs_config", None)
    if config is not None:
        backend = config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
        if isinstance(config, dict) and set(config) - {"backend"} or backend is None:
            raise ValueError(f"structured_outputs_config takes a backend alone here, got {config!r:.80}")
        _take(kwargs, "structured_outputs_backend", backend, "structured_outputs_config")
    if "guided_decoding_backend" in kwargs:  # (vLLM's older name)
        _take(kwargs, "structured_outputs_backend", kwargs.pop("guided_decoding_backend"), "guided_decoding_backend")
    if "compilation_config" in kwargs:
        compiled = _compile_spelling(kwargs.pop("compilation_config"))
        if compiled is not None:
            _take(kwargs, "torch_compile", compiled, "compilation_config")
    backend = kwargs.pop("distributed_executor_backend", None)
    if backend not in (None, "mp", "uni") or backend == "uni" and (kwargs.get("tensor_parallel_size") or 1) > 1:
        raise ValueError(f"distributed_executor_backend={backend!r:.40} is not supported here: tensor parallelism "
                         "runs one process per rank (\"mp\"), a single rank in-process (\"uni\"); Ray runs "
                         "data_parallel_size's replicas")
