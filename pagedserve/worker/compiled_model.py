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
    inductor caches the result on disk (~25 s the first time on 2 cores, ~5 s after);
  * later calls skip dynamo's guards: after the warm-up, the bytecode dynamo made of the
    model's forward (a call into the compiled graph) is taken from its cache, and steps
    run that bytecode directly, as vLLM does.  The guards (~7,000 on SmolLM2: every parameter, every
    quantized segment list) cost 2.3-2.9 ms a call on a Zen 3, 13% of a 135M-model
    decode step, and nothing they check changes between steps: the inputs are always
    slices of the runner's int64 buffers and the graph is dynamic in their length.
Anything that goes wrong while compiling leaves the engine on the eager model.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable
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
    return None


class CompiledModel:
    """Callable like `model(input_ids, positions)`; call `warm_up()` once before use."""

    skip_guards = True  # class-wide; tests turn it off to see that the guards would pass every step

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # Layers the graph calls back into, by index (layers/opaque.py).
        self.modules: list[Any] = [m for m in model.modules() if isinstance(m, (Attention, LinearBase, VocabParallelEmbedding))]
        for i, m in enumerate(self.modules):
            m.opaque_index = i
        self._compiled = torch.compile(model.forward, fullgraph=True)
        from torch._dynamo.decorators import mark_unbacked

        self._mark_unbacked = mark_unbacked
        self._direct: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with set_forward_context(get_forward_context().attn_metadata, self.modules):
            if self._direct is not None:
                return self._direct(self.model, input_ids, positions)
            self._mark_unbacked(input_ids, 0)
            self._mark_unbacked(positions, 0)
            return self._compiled(input_ids, positions)

    @torch.inference_mode()
    def warm_up(self, input_ids: torch.Tensor, positions: torch.Tensor) -> float:
        """Compile now, on two tokens of the runner's own input buffers (no KV cache);
        returns the seconds it took.  The buffers themselves, because guards check how a
        tensor was made: ones created under inference_mode would not match them."""
        t0 = time.perf_counter()
        ids, pos = input_ids[:2], positions[:2]
        with set_forward_context(None, self.modules):
            # Eagerly first: layers build state on first use (a quantized linear's kernel
            # arguments), and dynamo guards on what it reads, so state made during the
            # trace would fail the guards at the next step and compile the model again.
            self.model(ids, pos)
            self(ids, pos)
        code = self._compiled_code(ids, pos) if self.skip_guards else None
        if self.skip_guards and code is None:
            logger.warning("torch.compile: steps keep dynamo's guards (about 2-4 ms a step on CPU): "
                           "its cache holds no single entry whose guards pass after the warm-up")
        if code is not None:
            forward = self.model.forward.__func__
            self._direct = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__,
                                              forward.__closure__)
        return time.perf_counter() - t0

    def _compiled_code(self, input_ids: torch.Tensor, positions: torch.Tensor) -> types.CodeType | None:
        """The bytecode dynamo made of the model's forward for these inputs: the one cache
        entry whose guards pass (another model of the same class may have made it, when
        its guards pass for this one too); None if not exactly one, or if this torch's
        cache looks different."""
        forward = self.model.forward.__func__
        names = forward.__code__.co_varnames[: forward.__code__.co_argcount]
        self._mark_unbacked(input_ids, 0)
        self._mark_unbacked(positions, 0)
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            frame_locals = dict(zip(names, (self.model, input_ids, positions), strict=True))
            codes = [e.code for e in _debug_get_cache_entry_list(forward.__code__)
                     if e.guard_manager.check(frame_locals)]
        except (ImportError, AttributeError, TypeError, ValueError):
            return None
        return codes[0] if len(codes) == 1 else None

    @property
    def guard_free(self) -> bool:
        """Whether steps run the compiled bytecode directly, without dynamo's guards."""
        return self._direct is not None

    def detach(self) -> None:
        """Back to plain eager layers (after a failed compile)."""
        for m in self.modules:
            m.opaque_index = None


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
    `sample_inputs`: the (input_ids, positions) buffers steps will slice (default: new ones).

    An explicit request that cannot be honoured is an error; a default one is skipped
    with a log line, and a compile that fails falls back to eager with a warning."""
    if requested is False or (requested is None and enforce_eager):
        return None
    reason = compile_unavailable_reason(device, tensor_parallel_size)
    if reason is not None:
        if requested:
            raise ValueError(reason)
        logger.info("torch.compile off: %s", reason)
        return None
    logger.info("torch.compile: compiling the model (~25 s the first time on 2 cores, cached after; "
                "torch_compile=False skips it)")
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
    logger.info("torch.compile: ready in %.1f s", seconds)
    return compiled
