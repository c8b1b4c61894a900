"""The worker's adapters: which the model can hold, which are resident, and each step's rows.

`max_loras` slots (1..max_loras; slot 0 is the base model) hold adapters on the
model's device; behind them the loaded adapters, checked and converted in host memory
(the engine keeps max_cpu_loras loaded, unloading the least recently used idle ones), so
switching an adapter back in is a copy, not a file read.  An
adapter is checked against the model's own layers when loaded (`add_lora`, which the
engine calls between steps, never inside one): every module it targets must be a
linear layer here, with the shapes the base model has, so an adapter of another base
fails by name instead of computing something else.

A request takes a slot when it joins the batch (`acquire`) and gives it back when it
leaves (`release`); only an adapter no running request uses is evicted.  The
scheduler runs at most max_loras distinct adapters in one step, so a slot is always
free when a request needs one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from torch import nn

from pagedserve.config import LoRAConfig
from pagedserve.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from pagedserve.layers.lora import LinearLoRA, LoRABatch
from pagedserve.lora.peft import LoRAAdapterError, PeftAdapter, read_peft_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.models.utils import StackedMapping
from pagedserve.utils import record_startup

logger = logging.getLogger("pagedserve")


def lora_kernel() -> ModuleType | None:
    """The CPU kernel of layers/csrc/lora.cpp (built once per machine, ~10 s; cached), or
    None when it cannot be built (the layers then run the dense masked products)."""
    from pagedserve.cpu_extension import build_cpu_extension

    source = Path(__file__).resolve().parents[1] / "layers" / "csrc" / "lora.cpp"
    t0 = time.perf_counter()
    try:
        kernel = build_cpu_extension("pagedserve_lora", source, "LoRA kernel")
        record_startup("LoRA kernel", time.perf_counter() - t0)
        return kernel
    except Exception as e:  # noqa: BLE001 - a machine without a compiler still serves adapters
        logger.warning("the LoRA CPU kernel could not be built (%s: %s); adapters run as dense masked products",
                       type(e).__name__, e)
        return None


@dataclass
class LoadedAdapter:
    """An adapter checked against this model and laid out for this rank: per layer, the
    stacked A [R, in] and block-diagonal, pre-scaled B [out, R] (host memory)."""

    request: LoRARequest
    layers: dict[LinearBase, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.layers.values())


class LoRAModelManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, stacked_params: StackedMapping,
                 device: torch.device, dtype: torch.dtype) -> None:
        """`stacked_params`: the model's (fused layer, checkpoint name, shard) triples, so a
        PEFT target q_proj finds shard "q" of qkv_proj."""
        self.config = config
        self.device, self.dtype = device, dtype
        self.batch = LoRABatch(lora_kernel() if device.type == "cpu" else None)
        # PEFT module name -> (layer, shard of it; None: the whole layer)
        self.targets: dict[str, tuple[LinearBase, object]] = {}
        self._layer_loras: list[LinearLoRA] = []
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase):
                continue
            module.lora = LinearLoRA(self.batch, config.max_loras + 1)
            self._layer_loras.append(module.lora)
            prefix, _, leaf = name.rpartition(".")
            self.targets[name] = (module, None)
            for fused, checkpoint_name, shard in stacked_params:
                if fused == leaf:
                    self.targets[f"{prefix}.{checkpoint_name}" if prefix else checkpoint_name] = (module, shard)
        # Loaded adapters by id (which ones: the engine decides, LLMEngine.add_lora).
        self._loaded: dict[int, LoadedAdapter] = {}
        # What each target's A and B must be: (in, out) features of the whole layer (of the
        # shard, for a fused one), checked from the adapter file's header before it is read.
        self._shapes = {name: (layer.in_features * (layer.tp_size if layer.tp_dim == 1 else 1),
                               layer.shard_rows(shard)[3]) for name, (layer, shard) in self.targets.items()}
        self._lock = threading.Lock()  # add_lora may run beside a step (server threads)
        self.slot_ids: list[int | None] = [None] * (config.max_loras + 1)  # slot -> adapter id (slot 0: base)
        # slot -> the loaded adapter whose weights it holds: an id removed and loaded again
        # (another adapter, or the same files read anew) is a new one, never the old slot's.
        self._slot_adapter: list[LoadedAdapter | None] = [None] * (config.max_loras + 1)
        self.slot_refs = [0] * (config.max_loras + 1)
        self._slot_used = [0] * (config.max_loras + 1)  # last use, for LRU among free slots
        self._clock = 0

    # ------------------------------------------------------------------ loading
    def add_lora(self, request: LoRARequest) -> LoadedAdapter:
        """Read, check and convert the adapter into host memory (a no-op when it is there);
        LoRAAdapterError (a ValueError) names what is wrong with it."""
        with self._lock:
            loaded = self._loaded.get(request.lora_int_id)
            if loaded is not None:
                if loaded.request.lora_path != request.lora_path:
                    raise LoRAAdapterError(f"LoRA id {request.lora_int_id} is already adapter "
                                           f"{loaded.request.lora_name!r} at another path")
                return loaded
        adapter = read_peft_adapter(request.lora_path, self.config.max_lora_rank, self._shapes, self.dtype)
        loaded = LoadedAdapter(request, self._layout(adapter, request))
        with self._lock:
            self._loaded[request.lora_int_id] = loaded
        return loaded

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (False if it was not loaded); one a running request uses stays
        in its slot until that request leaves."""
        with self._lock:
            gone = self._loaded.pop(lora_id, None) is not None
            for slot, sid in enumerate(self.slot_ids):
                if sid == lora_id and self.slot_refs[slot] == 0:
                    self._clear_slot(slot)
                    self._repack()
            return gone

    def _layout(self, adapter: PeftAdapter, request: LoRARequest) -> dict[LinearBase, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: the shards' A stacked, their B (times the scaling) placed at the
        shard's rows of this rank's output, block-diagonally."""
        parts: dict[LinearBase, list[tuple[object, torch.Tensor, torch.Tensor]]] = {}
        for module_name, (a, b) in adapter.weights.items():
            layer, shard = self.targets[module_name]  # read_peft_adapter checked name and shapes
            if shard is None and layer.tp_size > 1 and isinstance(layer, (QKVParallelLinear,
                                                                          MergedColumnParallelLinear)):
                raise LoRAAdapterError(f"adapter {request.lora_name!r} targets the fused {module_name!r} (this "
                                       "model's name), which pagedserve splits only at tensor_parallel_size 1")
            parts.setdefault(layer, []).append((shard, a, b))
        out = {}
        for layer, shards in parts.items():
            a_rows, b_blocks = [], torch.zeros(layer.out_features, sum(a.shape[0] for _, a, _ in shards),
                                               dtype=torch.float32)
            col = 0
            for shard, a, b in shards:
                if layer.tp_dim == 1:  # input split across ranks: this rank's columns of A
                    a = a.narrow(1, layer.tp_rank * layer.in_features, layer.in_features)
                offset, size, start, _ = layer.shard_rows(shard)
                b_blocks[offset: offset + size, col: col + a.shape[0]] = b.float().narrow(0, start, size) * adapter.scaling
                a_rows.append(a.float())
                col += a.shape[0]
            out[layer] = (torch.cat(a_rows).to(self.dtype).contiguous(), b_blocks.to(self.dtype).contiguous())
        return out

    # ------------------------------------------------------------------ slots
    def acquire(self, request: LoRARequest) -> int:
        """The slot holding `request`'s adapter, activating it (loading it first if needed)."""
        loaded = self.add_lora(request)
        with self._lock:
            self._clock += 1
            lora_id = request.lora_int_id
            held = [s for s, adapter in enumerate(self._slot_adapter) if adapter is loaded]  # (by identity)
            if held:
                slot = held[0]
            else:
                free = [s for s in range(1, len(self.slot_ids)) if self.slot_refs[s] == 0]
                if not free:
                    raise RuntimeError(f"all {self.config.max_loras} LoRA slots are in use by running requests "
                                       "(the scheduler admits at most max_loras adapters at once)")
                slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self._slot_used[s]))
                self._clear_slot(slot)
                for layer, (a, b) in loaded.layers.items():
                    assert layer.lora is not None
                    layer.lora.slots[slot] = (a.to(self.device), b.to(self.device))
                self.slot_ids[slot], self._slot_adapter[slot] = lora_id, loaded
                self._repack()
            self.slot_refs[slot] += 1
            self._slot_used[slot] = self._clock
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self.slot_refs[slot] -= 1

    def _clear_slot(self, slot: int) -> None:
        for lora in self._layer_loras:
            lora.slots.pop(slot, None)
        self.slot_ids[slot] = self._slot_adapter[slot] = None

    def _repack(self) -> None:
        for lora in self._layer_loras:
            lora.pack()

    # ------------------------------------------------------------------ steps
    def set_step(self, slots: Iterable[int], num_tokens: np.ndarray) -> None:
        """This step's slot per row: `slots[i]` for the `num_tokens[i]` rows of request i."""
        per_req = np.fromiter(slots, np.int64, len(num_tokens))
        self.batch.token_slots = (torch.from_numpy(np.repeat(per_req, num_tokens)).to(self.device)
                                  if per_req.any() else None)

    def host_bytes(self) -> int:
        """Host memory of the loaded adapters (the LRU behind the slots)."""
        with self._lock:
            return sum(a.nbytes for a in self._loaded.values())

    def slot_bytes(self) -> int:
        """Memory of the resident adapters as the layers hold them (packed, on the model's device)."""
        with self._lock:
            return sum(lora.nbytes() for lora in self._layer_loras)
