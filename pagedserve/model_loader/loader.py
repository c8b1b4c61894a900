"""The loader's public entry points: resolve a ModelConfig, build the model, load the tokenizer.

`load_model_config` runs first (the engine needs max_model_len and the dtype before
it sizes the KV cache), fills in `model_config.hf_config`, `.max_model_len` and
`.dtype`, and fails early with a ValueError for unknown names, unsupported
architectures and impossible lengths.  `get_model` then builds the module directly
on the target device in the target dtype and fills it from the checkpoint.

Defaults, and why:
- dtype "auto" on CUDA is bfloat16 unless the checkpoint itself is float16 (or the GPU
  has no bf16).  On CPU it is bfloat16 where the CPU has bf16 instructions (AVX-512
  BF16, AMX: bf16 matmuls there run ~3x fp32) and float32 everywhere else: without them
  oneDNN emulates bf16 at ~1/8 of fp32's speed (an AVX2 Zen 3 measured 15 vs 120
  GFLOP/s at the decode shape), which costs a serving workload about 3x.  The choice
  and its reason are logged at start-up (cpu_info.bf16_support).  Float32 checkpoints
  (and dequantized GGUFs) are downcast as vLLM does; CPU float16 matmul is slow, so CPU
  never picks float16 by itself.  Pass dtype="float32" for exact HF parity.
- max_model_len None is the model's own limit: max_position_embeddings (stretched by a
  linear or YaRN rope scaling's factor, as vLLM does).  Families whose
  layers honour a sliding window (Gemma 3, Mistral) attend within it at any length; for
  the others a window in the config caps the limit at it (attention over at most
  `window` tokens is then the same as full attention).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.config import MAX_SPECULATIVE_TOKENS, QUANT_ACTIVATION_BITS, DeviceConfig, ModelConfig
from pagedserve.cpu_info import bf16_support
from pagedserve.layers.moe import FusedExperts
from pagedserve.layers.quantization import QuantizableLayer, quant_kernel_error
from pagedserve.layers.rotary_embedding import positions_limit, rope_params
from pagedserve.model_loader.config_snapshot import cached_config
from pagedserve.model_loader.sources import ModelSource, gguf_file_name, resolve_source
from pagedserve.models.registry import (
    SLIDING_WINDOW_ARCHITECTURES,
    check_config_file,
    check_supported_config,
    get_model_class,
    multimodal_architecture,
    resolve_architecture,
    snapshots_allowed,
)
from pagedserve.platforms import available_memory_bytes, is_cuda
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def resolve_device(device: DeviceConfig | torch.device | str | None) -> torch.device:
    if isinstance(device, DeviceConfig):
        device = device.device
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"invalid device {device!r} ({e})") from None


def _checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        return _DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def resolve_dtype(requested: str | torch.dtype, hf_config: Any, device: torch.device) -> torch.dtype:
    return _resolve_dtype(requested, hf_config, device)[0]


def _resolve_dtype(requested: str | torch.dtype, hf_config: Any, device: torch.device) -> tuple[torch.dtype, str]:
    """(dtype, why) -- the reason is what the start-up log says about an `auto` choice."""
    if isinstance(requested, torch.dtype):
        if requested not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {requested}; expected one of {', '.join(_DTYPE_NAMES.values())}")
        return requested, "as given"
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; expected 'auto' or one of {', '.join(_DTYPES)}")
        return _DTYPES[requested], "as given"
    if is_cuda(device):
        if _checkpoint_dtype(hf_config) == torch.float16 or not torch.cuda.is_bf16_supported():
            return torch.float16, "the checkpoint is float16 or this GPU has no bf16"
        return torch.bfloat16, "the GPU computes bf16 natively"
    bf16 = bf16_support()
    if bf16.native:
        return torch.bfloat16, f"{bf16.reason}, so bf16 matmuls run at full speed"
    return torch.float32, (f"{bf16.reason}: bf16 matmuls would be emulated at a fraction of float32's speed "
                           "(pass --dtype bfloat16 to use it anyway)")


def derive_max_model_len(hf_config: Any) -> int:
    """The longest sequence the model supports, and the rule we apply to it (see module docstring)."""
    limit = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if getattr(hf_config, key, None):
            limit = int(getattr(hf_config, key))
            break
    if limit is not None:
        limit = _rope_scaled_limit(hf_config, limit)
    window = _window(hf_config)
    if window and not _honours_window(hf_config):
        limit = min(limit, window) if limit else window
    if limit is None:
        raise ValueError("the model config gives no maximum length (max_position_embeddings); pass max_model_len")
    return limit


def _rope_scaled_limit(hf_config: Any, limit: int) -> int:
    """vLLM's rule: linear and YaRN scaling stretch the positions by their factor (YaRN from
    its original context), so the limit is that stretched length (Qwen2.5's documented
    128K: a 32,768-token config plus YaRN factor 4).  llama3 and LongRoPE configs give the
    stretched length as max_position_embeddings already, as Gemma 3's does."""
    params = rope_params(hf_config)
    if params["rope_type"] not in ("linear", "yarn") or "gemma3" in str(getattr(hf_config, "model_type", "")):
        return limit
    if params.get("factor") is None:  # (HF's YaRN derives it: max_position_embeddings over the original context)
        return limit
    base = params.get("original_max_position_embeddings") if params["rope_type"] == "yarn" else None
    return int((base or limit) * float(params["factor"]))


def _window(hf_config: Any) -> int | None:
    """The config's sliding window where some layer slides: Qwen2's use_sliding_window
    turns it on, and a layer_types list (transformers 5's) with no sliding layer (Qwen2's
    max_window_layers at or past its layer count) leaves none."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return None
    types = getattr(hf_config, "layer_types", None)
    return None if types is not None and "sliding_attention" not in types else int(window)


def _honours_window(hf_config: Any) -> bool:
    try:
        return resolve_architecture(hf_config) in SLIDING_WINDOW_ARCHITECTURES
    except ValueError:
        return False  # an unsupported architecture is refused by name later


def resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    limit = derive_max_model_len(hf_config)
    if requested is None:
        return limit
    if requested > limit:
        window = getattr(hf_config, "sliding_window", None)
        why = (" (its sliding window; sliding-window attention is not implemented for this family)"
               if window == limit else "")
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} tokens{why}")
    return requested


def _read_hf_config(source: ModelSource, trust_remote_code: bool) -> Any:
    """The model's config: transformers' (AutoConfig), or for the files every start reads
    again (GGUF files, registered models' conversions) the snapshot of it an earlier start
    saved (config_snapshot.py: no transformers config class imported)."""
    if source.path is None:  # a registered name with load_format="dummy"
        from transformers import AutoConfig

        cfg = dict(source.registered.hf_config)
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if os.path.isfile(source.path):
        from pagedserve.model_loader import gguf_utils

        return cached_config(source.path, lambda: gguf_utils.gguf_to_hf_config(gguf_utils.open_gguf(source.path),
                                                                               source.path), gguf_utils.__file__)
    config_json = os.path.join(source.path, "config.json")
    if not os.path.isfile(config_json):
        raise FileNotFoundError(f"no config.json in model directory {source.path}")
    if source.registered is not None or snapshots_allowed(source.path, trust_remote_code):
        # The next start of this directory reads the saved snapshot: no transformers import
        # (~3.6 s of a tiny model's 7.3 s `serve` start on a 2-core Zen 3, AVX2 only).  Vision models
        # keep transformers' composite config (its get_text_config, the image processors).
        return cached_config(config_json, lambda: _auto_config(source.path, False), directory=source.path)
    return _auto_config(source.path, trust_remote_code)


def _auto_config(path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        check_config_file(path)  # (a model_type transformers does not know: ours is the clearer refusal)
        raise ValueError(f"{path}/config.json: unreadable model config ({type(e).__name__}: {e})") from None


def load_model_config(model_config: ModelConfig, device: DeviceConfig | torch.device | str | None = None) -> Any:
    """Resolve `model_config` in place (hf_config, max_model_len, dtype name) and return the HF config."""
    source = resolve_source(model_config.model, model_config.load_format)
    hf_config = full_config = _read_hf_config(source, model_config.trust_remote_code)
    vision = multimodal_architecture(full_config)
    if vision is not None:
        # Everything but the model class reads the decoder's config (vocabulary, layers,
        # limits): it stands for the model, named by the checkpoint's architecture.
        hf_config = full_config.get_text_config()
        hf_config.architectures = [vision]
        model_config.hf_mm_config = full_config
    resolve_architecture(hf_config)  # unsupported architectures fail here, before any weights are read
    check_supported_config(hf_config)  # and math-changing fields we do not implement
    dtype, why = _resolve_dtype(model_config.dtype, full_config, resolve_device(device))
    if model_config.dtype == "auto":
        logger.info("dtype auto -> %s: %s", _DTYPE_NAMES[dtype], why)
    model_config.max_model_len = resolve_max_model_len(model_config.max_model_len, hf_config)
    model_config.dtype = _DTYPE_NAMES[dtype]
    model_config.hf_config = hf_config
    model_config.source_path = source.path
    folder = model_config.generation_config if model_config.generation_config not in ("auto", "vllm") else None
    model_config.generation_config_values = read_generation_config(folder or source.path)
    try:  # (out of range, every request was refused as if its own field were wrong)
        SamplingParams(**model_config.sampling_defaults())
    except ValueError as e:
        raise ValueError(f"{folder or source.path}: generation_config.json (or --override-generation-config) sets "
                         f"a sampling default out of range: {e}") from None
    if model_config.sampling_defaults():
        logger.info("sampling defaults (for fields a request leaves unset): %s, from %s", model_config.sampling_defaults(),
                    "--override-generation-config" if model_config.generation_config == "vllm" else
                    f"{folder or 'the model'}'s generation_config.json and --override-generation-config")
    return hf_config


def read_generation_config(path: str | None) -> dict[str, Any]:
    """generation_config.json in directory `path` (an HF model's, or --generation-config's), or {}."""
    import json

    file = os.path.join(path, "generation_config.json") if path and os.path.isdir(path) else None
    if file is None or not os.path.isfile(file):
        return {}
    try:
        with open(file) as f:
            values = json.load(f)
    except (OSError, ValueError):
        logger.warning("ignoring unreadable %s", file)
        return {}
    return values if isinstance(values, dict) else {}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def check_weight_files(source: ModelSource) -> None:
    """FileNotFoundError naming what a checkpoint directory lacks (its safetensors files,
    or shards its index lists): found before a model is built, or another one unloaded
    to make room for it (the server's model pool)."""
    if source.format == "safetensors":
        from pagedserve.model_loader.weight_utils import safetensors_files

        safetensors_files(source.path)


def get_model(model_config: ModelConfig, device: DeviceConfig | torch.device | str | None = None,
              dtype: torch.dtype | str | None = None) -> nn.Module:
    """The model, built on `device` in `dtype` (default: model_config's resolved dtype), weights loaded, eval mode."""
    target = resolve_device(device)
    if model_config.hf_config is None:
        load_model_config(model_config, target)
    hf_config = model_config.hf_config
    dtype = resolve_dtype(dtype if dtype is not None else model_config.dtype, hf_config, target)
    source = resolve_source(model_config.model, model_config.load_format)
    method, gguf_file = resolve_quantization(model_config.quantization, source, target)
    if method == "none" and model_config.quant_activation_bits != QUANT_ACTIVATION_BITS[0]:
        raise ValueError(f"quant_activation_bits={model_config.quant_activation_bits} applies to quantized linear "
                         f"layers, and this model runs none (quantization {model_config.quantization!r} resolved to "
                         "'none'): quantize it (quantization='int8' or 'int4', or a GGUF file on CPU) or leave "
                         f"quant_activation_bits at {QUANT_ACTIVATION_BITS[0]}")
    model_config.quantization = method  # resolved, like dtype (resolving again gives the same)
    model_cls = get_model_class(hf_config)
    check_weight_files(source)  # (before building anything: a directory without weights fails at once)
    # (positions past max_model_len never run: no rotary table holds them)
    limit = model_config.max_model_len + MAX_SPECULATIVE_TOKENS + 1 if model_config.max_model_len else None
    config = model_config.hf_mm_config or hf_config
    check_model_fits(model_cls, config, dtype, target, limit)
    with _default_dtype(dtype), target, positions_limit(limit) if limit else contextlib.nullcontext():
        model = model_cls(config)
    layers = [m for m in model.modules() if isinstance(m, QuantizableLayer)]
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]  # (a MoE's: quantized as a whole)
    for layer in layers:
        layer.set_prepack(model_config.prepack_weights)
    if source.format == "dummy":
        from pagedserve.model_loader.weight_utils import initialize_dummy_weights

        initialize_dummy_weights(model, model_config.seed)
        if method != "none":  # quantize the random weights as a checkpoint's would be
            for layer in layers:
                layer.enable_quantization(method, layer.weight.data.clone(), model_config.quant_activation_bits)
            for e in experts:
                e.enable_quantization(method, model_config.quant_activation_bits, now=True)
    else:
        if method != "none":
            for layer in layers:
                layer.enable_quantization(method, activation_bits=model_config.quant_activation_bits)
            for e in experts:
                e.enable_quantization(method, model_config.quant_activation_bits)
        _load_checkpoint(model, source, hf_config, gguf_file)
    if method != "none":
        _log_quantized(model, layers, method, model_config.quant_activation_bits)
    return model.eval()


def check_model_fits(model_cls: type[nn.Module], config: Any, dtype: torch.dtype, target: torch.device,
                     limit: int | None) -> None:
    """Refuse, naming the sizes, a model whose parameters and buffers as built (in `dtype`,
    before any quantization packs them) exceed the memory free on `target`.  A config.json
    past the machine (hidden_size 65536) failed with torch's "DefaultCPUAllocator: can't
    allocate memory", or, where each tensor fit the overcommit rule, the OOM killer ended
    the process (every other model a server held with it).  The same model built on the
    meta device first, which allocates nothing: ~30 ms for a 270M model."""
    try:
        with _default_dtype(dtype), torch.device("meta"), positions_limit(limit) if limit else contextlib.nullcontext():
            shell = model_cls(config)
    except Exception as e:  # noqa: BLE001 - a model that cannot be built on meta: the real build decides
        logger.debug("cannot size %s on the meta device (%s: %s)", model_cls.__name__, type(e).__name__, e)
        return
    need = sum(t.numel() * t.element_size() for t in (*shell.parameters(), *shell.buffers()))
    try:
        free = available_memory_bytes(target)
    except ValueError:  # (a host that cannot say: the real build decides)
        return
    if need > free:
        raise ValueError(f"{model_cls.__name__} as configured (hidden_size {getattr(config, 'hidden_size', '?')}, "
                         f"{getattr(config, 'num_hidden_layers', '?')} layers) takes {need / 2**30:.1f} GiB in "
                         f"{str(dtype).removeprefix('torch.')} as built, and {target} has {free / 2**30:.1f} GiB free")


def resolve_quantization(requested: str, source: ModelSource, device: torch.device) -> tuple[str, str | None]:
    """(method, GGUF file to read quantized blocks from): see ModelConfig.quantization."""
    gguf_file = source.path if source.format == "gguf" else None
    if gguf_file is None and source.format == "safetensors" and source.registered and source.registered.gguf_member:
        # a registered model's converted directory keeps the GGUF it came from
        candidate = os.path.join(source.path or "", gguf_file_name(source.registered))
        gguf_file = candidate if os.path.isfile(candidate) else None
    if requested == "auto":
        if not gguf_file or is_cuda(device):
            return "none", None
        error = quant_kernel_error()
        if error is not None:
            logger.warning("quantized CPU kernel unavailable (%s): dequantizing the GGUF instead", error)
            return "none", None
        return "gguf", gguf_file
    if requested == "none":
        return "none", None
    if is_cuda(device):
        raise ValueError(f"quantization={requested!r}: the quantized kernels run on CPU only "
                         "(use quantization='none' on CUDA)")
    error = quant_kernel_error()
    if error is not None:
        raise ValueError(f"quantization={requested!r} needs the quantized CPU kernel, which cannot be built "
                         f"here ({error}); use quantization='none'")
    if requested == "gguf":
        if source.format == "dummy":
            raise ValueError("quantization='gguf' needs GGUF weights; with load_format='dummy' use 'int8' or 'int4'")
        if gguf_file is None:
            raise ValueError(f"quantization='gguf' needs a GGUF file; {source.path} is not one "
                             "(use 'int8' or 'int4' to quantize a float checkpoint)")
        return "gguf", gguf_file
    if gguf_file is not None:
        logger.warning("quantization=%r quantizes the dequantized weights of %s again, rounding twice ('auto' or "
                       "'gguf' keep its own blocks)", requested, os.path.basename(gguf_file))
    return requested, None


def _log_quantized(model: nn.Module, layers: list[QuantizableLayer], method: str, activation_bits: int) -> None:
    quantized = [m for m in layers if m.qweight is not None]
    types = sorted({t for m in quantized if m.qweight is not None for t in m.qweight.source_types})
    qbytes = sum(m.qweight.nbytes() for m in quantized if m.qweight is not None)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    from pagedserve.layers.quantization import quant_kernel

    logger.info("quantization %s: %d layers keep %s weights (%.0f MB, kernel: %s, %d-bit activations); "
                "other weights %.0f MB", method, len(quantized), "/".join(types), qbytes / 2**20,
                quant_kernel().isa(), activation_bits, dense / 2**20)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    if experts:
        logger.info("quantization %s: %d layers' mixture-of-experts experts quantized too (%.0f MB)", method,
                    len(experts), sum(m.nbytes_quantized() for m in experts) / 2**20)


def _load_checkpoint(model: nn.Module, source: ModelSource, hf_config: Any, gguf_file: str | None = None) -> None:
    if gguf_file is not None:
        from pagedserve.model_loader.gguf_utils import iter_gguf_tensors, open_gguf

        weights = iter_gguf_tensors(open_gguf(gguf_file), hf_config, gguf_file, keep_quantized=True)
    elif source.format == "gguf":
        from pagedserve.model_loader.gguf_utils import iter_gguf_tensors, open_gguf

        weights = iter_gguf_tensors(open_gguf(source.path), hf_config, source.path)
    else:
        from pagedserve.distributed.parallel_state import get_tp_group
        from pagedserve.model_loader.weight_utils import iter_safetensors, safetensors_files

        # A tensor-parallel rank reads only its shard of each tensor (LazySlice.narrow).
        weights = iter_safetensors(safetensors_files(source.path), lazy=get_tp_group().world_size > 1)
    try:
        with torch.no_grad():
            model.load_weights(weights)
    except ValueError as e:
        message = str(e)
        raise ValueError(message if source.path in message else f"{source.path}: {message}") from None
