"""The model's forward under torch.compile (inductor), for CPU.

Why: a decode step on a small model is dozens of tiny eager ops per layer (RMSNorm
alone is nine), and on two CPU cores each costs more in dispatch and thread wake-up
than in arithmetic.  Compiling fuses everything *between* the matmuls and attention
into a few C++ loops; the matmuls (pre-packed oneDNN) and paged attention stay in
their eager code behind custom ops (layers/opaque.py).  On SmolLM2-135M in bf16 that
is ~15-20% more decode throughput (docs/performance.md).

How, so that it compiles once and never again:
  * one graph for every step: the token count is marked *unbacked* on each call, so
    dynamo neither specialises on it nor on the values 0 and 1 (a backed dynamic size
    would recompile the first time a single token runs);
  * attention metadata never enters the graph (the attention op reads it from the
    forward context), so nothing guards on a step's batch layout;
  * it is compiled at start-up by a two-token warm-up, not inside the first request;
  * later calls skip dynamo's guards: the model is compiled ahead of time
    (`aot_compile`) with every guard dropped, as vLLM does.  The guards (~7,000 on
    SmolLM2: every parameter, every quantized segment list) cost 2.3-2.9 ms a call on a
    Zen 3, 13% of a 135M-model decode step, and nothing they check changes between
    steps: the inputs are always slices of the runner's int64 buffers and the graph is
    dynamic in their length (tests compile with the guards too and check that they pass
    at every step shape);
  * the compiled function is saved under the cache directory (`compiled/`) and the next
    start loads it (~2 s) instead of tracing again (~8 s warm, ~25 s cold).  The loaded
    function reuses inductor's compiled kernels from its own cache (TORCHINDUCTOR_CACHE_DIR,
    /tmp/torchinductor_$USER by default); where that was cleared it recompiles them
    (~18 s).  With no guards to say when a saved graph no longer fits, the file is found
    by a key of everything the trace could have read (torch, the CPU's vector width,
    every module's class, parameter shapes and plain attributes: config values are
    baked into the graph as constants), it carries the checksums of the sources dynamo
    inlined, and it must run the warm-up tokens; any miss compiles again.
Anything that goes wrong while compiling leaves the engine on the eager model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import inspect
import io
import json
import logging
import os
import re
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.forward_context import get_forward_context, set_forward_context
from pagedserve.layers.attention import Attention
from pagedserve.layers.embedding import VocabParallelEmbedding
from pagedserve.layers.linear import LinearBase
from pagedserve.platforms import is_cpu

logger = logging.getLogger("pagedserve")


def compile_unavailable_reason(device: torch.device, tensor_parallel_size: int) -> str | None:
    """Why torch.compile cannot be used here, or None."""
    if not is_cpu(device):
        return f"torch_compile is implemented for CPU only (device {device}); CUDA uses CUDA graphs"
    if tensor_parallel_size > 1:
        return "torch_compile does not support tensor_parallel_size > 1 yet"
    try:
        from torch._dynamo.decorators import mark_unbacked  # noqa: F401
    except ImportError:
        return f"this torch ({torch.__version__}) lacks torch._dynamo.decorators.mark_unbacked"
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"this torch ({torch.__version__}) lacks ahead-of-time compilation (torch.compiler.load_compiled_function)"
    return None


class CompiledModel:
    """Callable like `model(input_ids, positions)`; call `warm_up()` once before use."""

    # Class-wide; tests turn it off to compile with dynamo's guards and see that they pass
    # at every step shape (what makes running without them safe).
    skip_guards = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # Layers the graph calls back into, by index (layers/opaque.py).
        self.modules: list[Any] = [m for m in model.modules() if isinstance(m, (Attention, LinearBase, VocabParallelEmbedding))]
        for i, m in enumerate(self.modules):
            m.opaque_index = i
        self._compiled = torch.compile(model.forward, fullgraph=True, options=inductor_options())
        from torch._dynamo.decorators import mark_unbacked

        self._mark_unbacked = mark_unbacked
        self._direct: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.loaded_from: str | None = None  # the saved compilation this model runs, if it was loaded
        self.artifact_path: str | None = None  # where its compilation is saved (guard-free only)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        with set_forward_context(context.attn_metadata, self.modules, context.bidirectional, context.common):
            if self._direct is not None:
                return self._direct(self.model, input_ids, positions)
            self._mark_unbacked(input_ids, 0)
            self._mark_unbacked(positions, 0)
            return self._compiled(input_ids, positions)

    @torch.inference_mode()
    def warm_up(self, input_ids: torch.Tensor, positions: torch.Tensor) -> float:
        """Compile now (or load a saved compilation), on two tokens of the runner's own
        input buffers (no KV cache); returns the seconds it took.  The buffers themselves,
        because guards check how a tensor was made: ones created under inference_mode
        would not match them."""
        t0 = time.perf_counter()
        ids, pos = input_ids[:2], positions[:2]
        with set_forward_context(None, self.modules):
            # Eagerly first: layers build state on first use (a quantized linear's kernel
            # arguments), which the trace must see as it will be at every step.
            want = self.model(ids, pos)
            if self.skip_guards:
                self._direct = self._guard_free(ids, pos, want)
            self(ids, pos)
        return time.perf_counter() - t0

    def _guard_free(self, ids: torch.Tensor, pos: torch.Tensor, want: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The forward compiled without guards: loaded from the cache when a saved one
        fits this model, else compiled and saved."""
        path = self.artifact_path = os.path.join(artifact_dir(), artifact_key(self.model) + ".bin")
        fn = load_artifact(path, type(self.model).forward.__globals__)
        if fn is not None and not _runs(fn, (self.model, ids, pos), want):
            logger.warning("torch.compile: the saved compilation %s does not run this model as it does; "
                           "compiling again", path)
            fn = None
        if fn is not None:
            self.loaded_from = path
            return fn
        self._mark_unbacked(ids, 0)
        self._mark_unbacked(pos, 0)
        compiled = torch.compile(type(self.model).forward, fullgraph=True,
                                 options={"guard_filter_fn": _no_guards, **inductor_options()},
                                 ).aot_compile(((self.model, ids, pos), {}))
        compiled.disable_guard_check()
        save_artifact(path, compiled)
        return compiled

    @property
    def guard_free(self) -> bool:
        """Whether steps run the compiled forward without dynamo's guards."""
        return self._direct is not None

    def detach(self) -> None:
        """Back to plain eager layers (after a failed compile)."""
        for m in self.modules:
            m.opaque_index = None


# --------------------------------------------------------------------------- saved compilations
ARTIFACT_MAGIC = b"pagedserve-compiled-1\n"
# Attributes bound to a layer at run time, never read by the graph: the attention layer's
# cache and backend (its eager code behind the opaque op reads them; their shapes change
# with memory) and a decoder layer's direct calls (a trace takes its modules).
RUNTIME_BOUND = frozenset({"kv_cache", "impl", "direct"})
# Where a Hugging Face config was read from: no forward computes with it, and keying on it
# made the same model at another path (a copy, a test's temporary directory) compile again.
# (`name_or_path` is the name a config snapshot saves it under: config_snapshot.py.)
PROVENANCE = frozenset({"_name_or_path", "name_or_path", "_commit_hash"})
# Inductor's generated wrapper checks the size and stride of every graph input and op
# output on every call: ~600 checks a step on SmolLM2-135M (every parameter is an input),
# 2-7% of a one-request decode step on 2 Zen 4 cores (AVX-512 with native bf16; noisy runs taking turns).  The inputs are the runner's own
# buffers and the model's parameters, and the opaque ops' outputs are made by our code,
# so the checks never fire.
INDUCTOR_OPTIONS: dict[str, Any] = {"size_asserts": False}
# Up to this many threads, inductor's own kernels (the fused norms, rotary, SwiGLU and
# residual adds between our ops) run on the calling thread.  Compiled for a token count
# it cannot see (the step's rows are unbacked), inductor opens an OpenMP region in every
# one of them, and in a decode step of a few rows the second thread has no row to take:
# the region's start and join are all it adds, ~9 per layer.  One request on 2 Zen 4
# cores (AVX-512 with native bf16), engines swapping the two compilations in one
# process: SmolLM2-135M 8.98 -> 8.34 ms a token, the 1.7B shape (Q4_0) 28.2 -> 27.6;
# 32 requests and a 1,000-token prefill unchanged at 135M, 1.6% and 2.6% slower at 1.7B
# (within noise / the fused kernels' share).  With more threads a big step's fused
# kernels gain more from splitting, unmeasured here, so those machines keep inductor's default.
SERIAL_KERNELS_MAX_THREADS = 2


def inductor_options() -> dict[str, Any]:
    """The options every compilation of the forward passes inductor (part of the saved
    compilation's key)."""
    options = dict(INDUCTOR_OPTIONS)
    if torch.get_num_threads() <= SERIAL_KERNELS_MAX_THREADS:
        options["cpp.threads"] = 1
    return options


def _no_guards(guards: list[Any]) -> list[bool]:
    return [False] * len(guards)


def artifact_dir() -> str:
    from pagedserve.model_loader.sources import cache_dir

    return os.path.join(cache_dir(), "compiled")


def artifact_key(model: nn.Module) -> str:
    """A digest of what a trace of `model.forward` can read as a constant: the software
    (torch's and Python's versions, not where they are installed: a new virtual
    environment of the same versions, as CI makes each run, loads what the last one
    saved; the sources the trace inlined are checked on load), the vector width inductor
    generates for, and every module's class, tensors' shapes and dtypes, and plain
    attributes (config values: eps, rope bases, head counts)."""
    from torch._inductor import config as inductor_config

    from pagedserve.layers import fused_ops

    parts: list[Any] = [ARTIFACT_MAGIC.decode(), inductor_options(), torch.__version__, sys.version,
                        torch.backends.cpu.get_cpu_capability(), inductor_config.cpp.simdlen, fused_ops.OVERRIDE,
                        torch.get_default_dtype()]
    for name, module in model.named_modules():
        state = {k: v for k, v in vars(module).items() if k not in RUNTIME_BOUND and k != "_modules"}
        parts.append((name, _qualname(type(module)), _describe(state, 4)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _describe(value: Any, depth: int) -> Any:
    """A plain, process-independent description of `value` (no ids, no tensor data)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)):
        return value if not isinstance(value, (torch.dtype, torch.device, enum.Enum)) else str(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", type(value).__name__, tuple(value.shape), str(value.dtype), value.stride(),
                str(value.device), value.requires_grad)
    if depth <= 0:
        return _qualname(type(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_describe(v, depth - 1) for v in value])
    if isinstance(value, dict):
        return ("dict", sorted((str(k), _describe(v, depth - 1)) for k, v in value.items() if k not in PROVENANCE))
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)):
        return _qualname(value)
    if type(value).__module__ == "torch._ops":  # an operator the graph calls by name (our kernels' are hashed)
        return ("op", str(value))
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, nn.Module):
        return ("submodule", _qualname(type(value)))  # described on its own
    if dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
        return (_qualname(type(value)), _describe(vars(value), depth - 1))
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))  # (an address would make every key new)
    return (_qualname(type(value)), text if len(text) < 200 else "")


def _source_sums(modules: list[str]) -> dict[str, str]:
    """sha256 of each module's source, by module name ('' where it has none)."""
    sums = {}
    for name in sorted(modules):
        try:
            sums[name] = hashlib.sha256(inspect.getsource(sys.modules[name]).encode()).hexdigest()
        except (KeyError, OSError, TypeError):
            sums[name] = ""
    return sums


def save_artifact(path: str, compiled: Any) -> None:
    """Write the compiled forward with the checksums of the sources it inlined (atomically;
    a cache that cannot be written only costs the next start its compile)."""
    try:
        modules = [s.module for s in compiled.source_info().inlined_sources]
        header = json.dumps({"sources": _source_sums(modules)}).encode()
        data = type(compiled).serialize(compiled).serialized_data
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(ARTIFACT_MAGIC + len(header).to_bytes(8, "little") + header + data)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - unwritable directory, unpicklable state: run, just unsaved
        logger.warning("torch.compile: could not save the compiled model to %s (%s: %s)", path, type(e).__name__, e)


def load_artifact(path: str, f_globals: dict[str, Any] | None = None) -> Callable[..., torch.Tensor] | None:
    """The saved compiled forward at `path` if there is one and the sources it inlined are
    unchanged, else None (a file that cannot be read is only a cache miss).  `f_globals`:
    the forward's module globals, which the compiled bytecode may name (`torch`)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            blob = f.read()
        if not blob.startswith(ARTIFACT_MAGIC):
            raise ValueError("not a saved compilation")
        at = len(ARTIFACT_MAGIC)
        size = int.from_bytes(blob[at:at + 8], "little")
        header = json.loads(blob[at + 8:at + 8 + size])
        if _source_sums(list(header["sources"])) != header["sources"]:
            logger.info("torch.compile: sources changed since %s was saved; compiling again", path)
            return None
        fn = torch.compiler.load_compiled_function(io.BytesIO(blob[at + 8 + size:]), f_globals=f_globals)
        fn.disable_guard_check()
        return fn
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: compile again and overwrite it
        logger.warning("torch.compile: could not load %s (%s: %s); compiling again", path, type(e).__name__, e)
        return None


def _runs(fn: Callable[..., torch.Tensor], args: tuple[Any, ...], want: torch.Tensor) -> bool:
    """Whether a loaded compilation runs the warm-up tokens and gives the eager output's
    shape and dtype (a graph calling an operator this process lacks fails here).  Values
    are not compared: compiled and eager bf16 differ by more on two tokens than a stale
    constant would."""
    try:
        got = fn(*args)
    except Exception:  # noqa: BLE001 - e.g. an operator this process does not have
        return False
    return isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype


def _key_cache_by_cpu_isa() -> None:
    """Make the vector width inductor generates for part of its on-disk cache key.

    Left unset, inductor picks the width from ATen's CPU capability but does not key its
    FX-graph cache by it: a graph compiled under ATEN_CPU_CAPABILITY=avx2 (how we
    emulate AVX2-only CPUs) and loaded by a default process on an AVX-512 CPU corrupted
    the heap (torch 2.13, reproduced).  Naming the width it would pick anyway keys the
    cache and changes nothing else."""
    from torch._inductor import config as inductor_config

    if inductor_config.cpp.simdlen is None:
        capability = torch.backends.cpu.get_cpu_capability()
        inductor_config.cpp.simdlen = {"AVX512": 512, "AVX2": 256}.get(capability)


def maybe_compile(model: nn.Module, device: torch.device, requested: bool | None, enforce_eager: bool,
                  tensor_parallel_size: int, sample_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
                  ) -> CompiledModel | None:
    """The compiled model when compiling applies (requested, or by default on CPU), else None.
    (ModelRunner requests False where every decoder layer runs direct fused-kernel calls.)
    `sample_inputs`: the (input_ids, positions) buffers steps will slice (default: new ones).

    An explicit request that cannot be honoured is an error; a default one is skipped
    with a log line, and a compile that fails falls back to eager with a warning."""
    if requested is False or (requested is None and enforce_eager):
        return None
    with _triton_hidden(device):
        return _compile(model, device, requested, tensor_parallel_size, sample_inputs)


@contextlib.contextmanager
def _triton_hidden(device: torch.device) -> Iterator[None]:
    """Keep Triton out of a CPU process while torch.compile loads or compiles: importing
    torch._dynamo imports Triton where it is installed (xgrammar requires it) only to
    note its version, which a CPU compilation never uses (its compatibility check reads
    it for GPUs alone).  SmolLM2-135M's server, one slot, Zen 4 (AVX-512 with native
    bf16): 73 MB less resident and ~0.2 s less start-up.  A process that already imported
    it keeps it; once the compile is done Triton imports again for anyone who asks (the
    version torch noted, (0, 0), serves GPU compilations only).  Meanwhile another
    thread's `import triton` would fail: start-up runs this before any request thread
    could want it."""
    if not is_cpu(device) or "triton" in sys.modules:
        yield
        return
    sys.modules["triton"] = None  # type: ignore[assignment]  # `import triton` raises ImportError
    try:
        yield
    finally:
        if "triton" in sys.modules and sys.modules["triton"] is None:
            del sys.modules["triton"]


def _compile(model: nn.Module, device: torch.device, requested: bool | None, tensor_parallel_size: int,
             sample_inputs: tuple[torch.Tensor, torch.Tensor] | None) -> CompiledModel | None:
    reason = compile_unavailable_reason(device, tensor_parallel_size)
    if reason is not None:
        if requested:
            raise ValueError(reason)
        logger.info("torch.compile off: %s", reason)
        return None
    logger.info("torch.compile: compiling the model (~25 s the first time on 2 cores; a saved compilation "
                "loads in ~2 s; torch_compile=False skips it)")
    _key_cache_by_cpu_isa()
    compiled = CompiledModel(model)
    if sample_inputs is None:
        sample_inputs = (torch.zeros(2, dtype=torch.int64, device=device),
                         torch.zeros(2, dtype=torch.int64, device=device))
    try:
        seconds = compiled.warm_up(*sample_inputs)
    except Exception as e:  # noqa: BLE001 - an op inductor cannot handle: stay correct, eager
        compiled.detach()
        logger.warning("torch.compile failed, running eagerly (%s: %s); pass torch_compile=False "
                       "to skip the attempt", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    how = f"loaded {compiled.loaded_from}" if compiled.loaded_from else "compiled"
    logger.info("torch.compile: ready in %.1f s (%s)", seconds, how)
    return compiled
