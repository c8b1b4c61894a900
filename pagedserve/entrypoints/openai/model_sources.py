"""The models a server may serve, from its command line: `pagedserve serve MODEL
[MODEL ...]` and `--models-dir DIR`, each named as clients will ask for it, with the
flags that govern how many stay loaded (model_pool.py does the loading)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any

from pagedserve.entrypoints.openai.model_pool import (
    DEFAULT_KEEP_ALIVE,
    ModelSpec,
    check_not_latest,
    parse_keep_alive,
    without_latest,
)

if TYPE_CHECKING:
    from pagedserve.engine.arg_utils import EngineArgs

logger = logging.getLogger("pagedserve.api_server")

MAX_MODELS = 256  # servable models per server (a directory of thousands is a mistake)


def add_model_pool_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--models-dir", default=None, metavar="DIR",
                       help="serve every GGUF file and Hugging Face model directory in DIR too, each named by its "
                            "file (without .gguf) or folder; loaded on first use")
    group.add_argument("--max-loaded-models", type=int, default=1,
                       help="models loaded at once when several are served; the least recently used idle one is "
                            "unloaded to make room (Ollama: OLLAMA_MAX_LOADED_MODELS; default: 1)")
    group.add_argument("--keep-alive", default=None, metavar="DURATION",
                       help="how long a model stays loaded after its last request when several are served "
                            "('5m', '30s', '1h'; 0 unloads at once; -1 keeps it; a request's keep_alive overrides "
                            "it; default: 5m, and a server of one model keeps it loaded)")
    group.add_argument("--max-models-memory", default=None, metavar="BYTES",
                       help="memory the loaded models may take together, weights and KV caches (bytes, or with a "
                            "unit: 12GiB); a model loads only when it fits, after idle ones are unloaded "
                            "(default: 90%% of the memory available at start, when several models are served)")


def model_name(source: str) -> str:
    """The name clients use for a model given by `source`: a registered name or Hub id
    as written, a file's name without .gguf, a directory's folder name; without a
    `:latest` tag (a folder `NAME:latest` is served as NAME, as Ollama reads it)."""
    path = source.rstrip("/")
    if os.path.isfile(path):
        base = os.path.basename(path)
        return without_latest(base[: -len(".gguf")] if base.lower().endswith(".gguf") else base)
    if os.path.isdir(path):
        return without_latest(os.path.basename(os.path.abspath(path)))
    return without_latest(source)


def models_in_dir(directory: str) -> list[str]:
    """Every GGUF file and HF model directory (one with config.json) directly in
    `directory`, sorted by name."""
    if not os.path.isdir(directory):
        raise ValueError(f"--models-dir {directory!r} is not a directory")
    found = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if entry.startswith("."):
            continue
        if (os.path.isfile(path) and entry.lower().endswith(".gguf")) or \
                os.path.isfile(os.path.join(path, "config.json")):
            found.append(path)
    if not found:
        raise ValueError(f"--models-dir {directory!r} has no GGUF file and no model directory (one with config.json)")
    return found


def model_specs(sources: list[str], models_dir: str | None, served_names: list[str] | None) -> list[ModelSpec]:
    """The servable models, the first being the default.  One MODEL keeps today's
    naming (its argument, or --served-model-name); several, or one found in
    --models-dir (a path there is the operator's), are named by model_name."""
    given = list(sources)
    sources = given + (models_in_dir(models_dir) if models_dir is not None else [])
    if len(sources) > MAX_MODELS:
        raise ValueError(f"{len(sources)} models is more than one server serves ({MAX_MODELS})")
    if len(sources) == 1:
        names = served_names or [sources[0] if given else model_name(sources[0])]
        if not all(n.strip() for n in names):  # (a model named "" answered as "")
            raise ValueError("--served-model-name: a name must not be empty")
        for name in served_names or ():
            check_not_latest(name, "--served-model-name")
        return [ModelSpec(names[0], sources[0], tuple(names[1:]))]
    if served_names:
        raise ValueError("--served-model-name names the one model served; with several, each is named by its "
                         "argument, file or folder")
    return [ModelSpec(model_name(s), s) for s in sources]  # (ModelPool refuses two of one name)


def pool_options(args: argparse.Namespace, num_models: int, device: str) -> dict[str, Any]:
    """ModelPool's keyword arguments from the flags (ValueError naming a bad one).  The
    default memory budget is the host's, for models on the CPU; on a GPU each engine
    sizes its cache by gpu_memory_utilization, one model at a time by default."""
    from pagedserve.platforms import available_memory_bytes
    from pagedserve.utils import parse_bytes

    if args.max_loaded_models < 1:
        raise ValueError(f"--max-loaded-models must be >= 1, got {args.max_loaded_models}")
    several = num_models > 1
    idle = [flag for flag, unset in (("--keep-alive", args.keep_alive is None), ("--max-loaded-models",
                                     args.max_loaded_models == 1), ("--max-models-memory", args.max_models_memory is None))
            if not unset and not several]
    for flag in idle:  # (as --max-log-len without --enable-log-requests)
        logger.warning("%s has no effect with one model served: it stays loaded", flag)
    if args.keep_alive is not None:
        keep_alive = parse_keep_alive(args.keep_alive, "--keep-alive")
    else:
        keep_alive = DEFAULT_KEEP_ALIVE if several else None
    budget = None
    if args.max_models_memory is not None:
        budget = parse_bytes(args.max_models_memory, "--max-models-memory")
        if budget <= 0:
            raise ValueError("--max-models-memory must be positive")
    elif several:
        import torch

        from pagedserve.model_loader.loader import resolve_device

        if resolve_device(device).type != "cpu":
            return {"max_loaded": args.max_loaded_models, "keep_alive": keep_alive, "memory_budget": None,
                    "max_waiting": args.max_waiting_requests}
        budget = int(available_memory_bytes(torch.device("cpu")) * 0.9)
    return {"max_loaded": args.max_loaded_models, "keep_alive": keep_alive, "memory_budget": budget,
            "max_waiting": args.max_waiting_requests}


def check_model_config(engine_args: EngineArgs, spec: ModelSpec) -> int | None:
    """`spec`'s config against the server's flags (a --max-model-len past its limit, a
    family not served here) and its weight files, where its files are on this machine: a
    ValueError or FileNotFoundError before the pool unloads another model for a load that
    would fail (one not fetched yet is checked as it loads); else the max_model_len it
    will serve (None: not fetched yet)."""
    from pagedserve.model_loader.loader import check_weight_files
    from pagedserve.model_loader.sources import local_model, resolve_source

    if local_model(spec.source) is None:
        return None
    config = engine_args.replace(model=spec.source).create_engine_config().model_config
    check_weight_files(resolve_source(config.model, config.load_format))
    return config.max_model_len
