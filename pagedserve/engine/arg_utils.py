"""EngineArgs: the flat, user-facing knobs (vLLM's names) and their one translation
into the EngineConfig tree.

`LLM(...)`, `pagedserve generate/chat/serve` and the benchmarks all build an
EngineArgs, so a knob is named, documented, validated and turned into a CLI flag in
exactly one place.  Everything is checked here, before any weights are loaded, so a
typo costs milliseconds and the message names the argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from pagedserve import envs
from pagedserve.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    MAX_HOST_TIER_SHARE,
    PREEMPTION_MODES,
    PREFIX_CACHING_ALGOS,
    QUANT_ACTIVATION_BITS,
    QUANTIZATION_METHODS,
    ROUTER_POLICIES,
    RUNNERS,
    SPECULATION_OFF,
    STRUCTURED_OUTPUT_BACKENDS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    RouterConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    default_max_step_ms,
    default_speculative_config,
)
from pagedserve.engine.arg_help import HELP
from pagedserve.engine.arg_spellings import add_vllm_flags, vllm_flags_given, vllm_spellings
from pagedserve.utils import is_int, is_number, parse_bytes, readable_number

logger = logging.getLogger("pagedserve")
DEFAULT_MODEL = "smollm2-135m-instruct"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# Upper bound on default step budget; a larger max_model_len still works through chunked prefill.
_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# vLLM's largest block size: a block is the unit of prefix reuse and of allocation.
MAX_BLOCK_SIZE = 256


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    kv_cache_memory_bytes: int | str | None = None
    kv_cache_memory_ceiling: int | str | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    prefix_caching_algo: str = "hash"
    kv_offload_dir: str | None = None
    kv_offload_bytes: int | str | None = None
    preemption_mode: str = "recompute"
    seed: int = 0
    max_logprobs: int = 20
    max_n: int = 16
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | str | None = None  # a JSON object on the command line
    load_format: str = "auto"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    # Data parallelism (engine/data_parallel.py): replicas on Ray behind one router.  The
    # router fields are None when not given: they mean something only with replicas.
    data_parallel_size: int = 1
    ray_address: str | None = None
    cpus_per_replica: int | None = None
    router_policy: str | None = None
    router_cache_threshold: float | None = None
    router_balance_abs_threshold: int | None = None
    router_balance_rel_threshold: float | None = None
    chat_template: str | None = None
    attention_backend: str | None = None
    exact_prompt_attention: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    trust_remote_code: bool = False
    async_scheduling: bool | None = None  # None: on for CUDA
    torch_compile: bool | None = None  # None: $PAGEDSERVE_TORCH_COMPILE, else the runner decides (CPU, tp 1)
    structured_outputs_backend: str = "auto"
    quantization: str = "auto"
    quant_activation_bits: int = QUANT_ACTIVATION_BITS[0]
    prepack_weights: bool = True
    max_step_ms: float | None = None  # None: config.default_max_step_ms for the device; 0: off
    # Speculative decoding, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2}; a JSON string on the command line;
    # "off" for none; None: config.default_speculative_config (n-gram on CPU).
    speculative_config: dict[str, Any] | str | None = None
    kv_cache_dtype: str = "auto"
    runner: str = RUNNERS[0]
    # The pooling runner's PoolerConfig fields; a JSON string on the command line.
    pooler_config: dict[str, Any] | str | None = None
    # Multi-LoRA serving (LoRAConfig): adapters picked per request.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Image input (vision-language models), vLLM's names (arg_help.HELP says what each does).
    limit_mm_per_prompt: dict[str, int] | str | None = None
    allowed_media_domains: list[str] | str | None = None
    disable_chunked_mm_input: bool = False
    encoder_cache_size: int | None = None

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_kwargs(cls, caller: str = "EngineArgs", **kwargs: Any) -> EngineArgs:
        """EngineArgs(**kwargs), an unknown name a TypeError listing the valid ones, vLLM's
        spellings taken (`vllm_spellings`), None the default where it is no value of the
        field (`LLM(**vars(args))` of add_cli_args' unset flags, as from_cli_args reads them)."""
        kwargs = vllm_spellings(kwargs)
        valid = {f.name: f for f in fields(cls)}
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise TypeError(
                f"{caller} got unexpected engine argument(s): {', '.join(unknown)}. "
                f"Valid engine arguments: {', '.join(sorted(valid))}"
            )
        return cls(**{k: v for k, v in kwargs.items() if v is not None or valid[k].default is None})

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        """Check every argument, in a fixed order (so the one named is always the same):
        types and ranges first, then the KV tier and replicas, then the parsed JSON
        arguments and the combinations that do not work together."""
        self._validate_model_and_sizes()
        self._validate_kv_tier()
        self._validate_data_parallel()
        self._validate_scalars()
        self._speculative = self._parse_speculative_config()
        self._pooler = self._parse_pooler_config()
        self._lora = self._lora_config()
        self._media = self._media_arguments()
        self._validate_combinations()
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise self._bad("chat_template", "a template string or a file path")
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise self._bad("attention_backend", "a backend name or None")

    def _bad(self, name: str, allowed: str) -> ValueError:
        return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

    def _validate_model_and_sizes(self) -> None:
        """What the model is, where it runs, and the sizes the later checks read."""
        if not isinstance(self.model, str) or not self.model:
            raise self._bad("model", "a non-empty string (registry name, directory or .gguf path)")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise self._bad("tokenizer", "a string or None")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise self._bad("device", "'auto', 'cpu', 'cuda' or 'cuda:N'")
        for name in ("max_num_batched_tokens", "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise self._bad(name, "a positive integer or None")
        for name in ("tensor_parallel_size", "data_parallel_size"):  # the checks below read them
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise self._bad(name, "a positive integer")
        if not is_int(self.block_size) or not 1 <= self.block_size <= MAX_BLOCK_SIZE or \
                self.block_size & (self.block_size - 1):  # (2^20 was a "KV cache too small" naming other flags)
            raise self._bad("block_size", f"a power of two from 1 to {MAX_BLOCK_SIZE} (e.g. 16 or 32)")
        for name in ("kv_cache_memory_bytes", "kv_cache_memory_ceiling"):
            if getattr(self, name) is not None:
                setattr(self, name, parse_bytes(getattr(self, name), name))

    def _validate_scalars(self) -> None:
        """Numbers, names and flags, each on its own."""
        if not is_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise self._bad("gpu_memory_utilization", "in (0, 1]")
        if not is_int(self.seed) or not -2**63 <= self.seed < 2**64:  # (past it: "Overflow when unpacking long long")
            raise self._bad("seed", "a 64-bit integer")
        if not is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise self._bad("max_logprobs", "an integer >= 0")
        self._generation_overrides = _generation_overrides(self.generation_config, self.override_generation_config)
        if self.load_format not in LOAD_FORMATS:
            raise self._bad("load_format", f"one of {', '.join(LOAD_FORMATS)}")
        for name in ("enable_prefix_caching", "enforce_eager", "enable_chunked_prefill", "trust_remote_code",
                     "prepack_weights", "disable_chunked_mm_input", "exact_prompt_attention"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, "True or False")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise self._bad("async_scheduling", "True, False or None (on for CUDA)")
        if self.torch_compile is not None and not isinstance(self.torch_compile, bool):
            raise self._bad("torch_compile", "True, False or None (the default)")

    def _validate_combinations(self) -> None:
        """Arguments valid alone that do not work together (yet)."""
        if self._speculative is not None and self.async_scheduling:
            raise ValueError("speculative_config does not work with async_scheduling=True yet (a step's drafts "
                             "depend on the previous step's tokens); turn one of them off")
        if (self._speculative is not None and self._speculative.method == "draft_model"
                and self.tensor_parallel_size > 1):
            raise ValueError("speculative_config.model: a draft model does not run under tensor parallelism yet "
                             "(tensor_parallel_size > 1); n-gram speculation does ({\"method\": \"ngram\"})")
        if self.torch_compile and self.enforce_eager:
            raise ValueError("torch_compile=True contradicts enforce_eager=True (which never compiles)")

    def _validate_kv_tier(self) -> None:
        if self.prefix_caching_algo not in PREFIX_CACHING_ALGOS:
            raise ValueError(f"prefix_caching_algo must be 'hash' or 'radix', got {self.prefix_caching_algo!r}")
        if self.prefix_caching_algo == "radix" and not self.enable_prefix_caching:
            raise ValueError("prefix_caching_algo='radix' indexes the prefix cache: it needs enable_prefix_caching")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.kv_offload_dir is not None and (not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir):
            raise ValueError(f"kv_offload_dir must be a directory path, got {self.kv_offload_dir!r}")
        if self.kv_offload_dir is not None and os.path.lexists(self.kv_offload_dir) and \
                not os.path.isdir(self.kv_offload_dir):  # (a mistyped path: the tier went off with a warning)
            raise ValueError(f"kv_offload_dir {self.kv_offload_dir!r} is not a directory")
        if self.kv_offload_bytes is not None:
            self.kv_offload_bytes = parse_bytes(self.kv_offload_bytes, "kv_offload_bytes")
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if self.kv_offload_dir is None and self.kv_offload_bytes > MAX_HOST_TIER_SHARE * total:
                raise ValueError(f"kv_offload_bytes (or vLLM's swap_space) of {self.kv_offload_bytes / 2**30:.3g} GiB "
                                 f"of host memory is more than {MAX_HOST_TIER_SHARE:.0%} of this machine's "
                                 f"{total / 2**30:.3g} GiB: the tier would fill memory as prefixes are computed; "
                                 "give less, or a kv_offload_dir for a tier on disk")
        tier = self.kv_offload_dir is not None or self.kv_offload_bytes is not None
        if not tier and self.preemption_mode == "recompute":
            return
        what = "kv_offload_dir/kv_offload_bytes" if tier else "preemption_mode='swap'"
        if self.tensor_parallel_size > 1:
            raise ValueError(f"{what}: a KV tier does not work under tensor parallelism yet "
                             "(tensor_parallel_size > 1)")
        if tier and not self.enable_prefix_caching and self.preemption_mode != "swap":
            raise ValueError("kv_offload_dir/kv_offload_bytes: the KV tier holds prefix-cache blocks, so it needs "
                             "enable_prefix_caching (or preemption_mode='swap', which uses it without)")

    def _validate_data_parallel(self) -> None:
        if self.data_parallel_size == 1:
            given = [n for n in ("ray_address", "cpus_per_replica") if getattr(self, n) is not None]
            given += [f"router_{k}" for k in self.router_settings()]
            if given:
                raise ValueError(f"{', '.join(given)}: only data-parallel replicas use this; set "
                                 "data_parallel_size > 1 (or leave it out)")
            return
        self.router_config()  # its own checks, naming the argument
        address = self.ray_address
        if address is not None and (not isinstance(address, str) or not re.fullmatch(r"auto|[\w.\-]+:\d+", address)):
            raise ValueError(f"ray_address must be 'auto' or HOST:PORT of the cluster's head, got {address!r}")
        if self.cpus_per_replica is not None and (not is_int(self.cpus_per_replica) or self.cpus_per_replica < 1):
            raise ValueError(f"cpus_per_replica must be a positive integer, got {self.cpus_per_replica!r}")

    def router_settings(self) -> dict[str, Any]:
        """The router_* arguments given (not None), as RouterConfig fields."""
        settings = {"policy": self.router_policy, "cache_threshold": self.router_cache_threshold,
                    "balance_abs_threshold": self.router_balance_abs_threshold,
                    "balance_rel_threshold": self.router_balance_rel_threshold}
        return {k: v for k, v in settings.items() if v is not None}

    def router_config(self) -> RouterConfig:
        return RouterConfig(**self.router_settings())

    def for_replica(self, index: int) -> EngineArgs:
        """One data-parallel replica's own engine: no replicas of its own, its own GPUs, and
        a KV tier directory of its own (two engines writing one directory would evict each
        other's files behind their backs)."""
        tier_dir = None if self.kv_offload_dir is None else os.path.join(self.kv_offload_dir, f"replica-{index}")
        # Ray shows a replica only its own GPUs (CUDA_VISIBLE_DEVICES): "cuda:3" means nothing there.
        device = "cuda" if self.device.startswith("cuda") else self.device
        return self.replace(data_parallel_size=1, device=device, ray_address=None, cpus_per_replica=None, router_policy=None,
                            router_cache_threshold=None, router_balance_abs_threshold=None,
                            router_balance_rel_threshold=None, kv_offload_dir=tier_dir)

    def _parse_pooler_config(self) -> PoolerConfig | None:
        """The JSON of --pooler-config as a PoolerConfig (ModelConfig checks it goes with
        runner='pooling'), and what the pooling runner cannot be combined with: a pooling
        request never decodes, so nothing can decode ahead of it."""
        if self.runner == "pooling":
            for name, given in (("speculative_config", self._speculative is not None),
                                ("async_scheduling=True", self.async_scheduling is True),
                                ("data_parallel_size > 1", self.data_parallel_size > 1)):
                if given:
                    raise ValueError(f"runner='pooling' does not work with {name} (yet)")
        value = _json_argument(self.pooler_config, "pooler_config")
        return None if value is None else PoolerConfig.from_dict(value)

    def _media_arguments(self) -> tuple[dict[str, int], list[str] | None]:
        """(limit_mm_per_prompt, allowed_media_domains) as ModelConfig takes (and checks) them."""
        limit = _json_argument(self.limit_mm_per_prompt, "limit_mm_per_prompt")
        domains = self.allowed_media_domains
        if isinstance(domains, str):
            domains = [d.strip() for d in domains.split(",") if d.strip()] or None
        return ({"image": 8} if limit is None else limit), domains

    def _warn_image_flags(self) -> None:
        """The image flags, given to a model that reads no images: each named (a text-only
        server took --limit-mm-per-prompt in silence)."""
        for name in ("limit_mm_per_prompt", "allowed_media_domains", "encoder_cache_size", "disable_chunked_mm_input"):
            if getattr(self, name) != EngineArgs.__dataclass_fields__[name].default:
                logger.warning("%s has no effect: this model reads no images", name)

    def _warn_lora_flags(self) -> None:
        """The adapter flags, given without enable_lora (each sizes what it turns on): named
        once per engine built (here, not at each EngineArgs made: `generate` said it 4 times)."""
        for name in _LORA_SIZES:
            if not self.enable_lora and getattr(self, name) != EngineArgs.__dataclass_fields__[name].default:
                logger.warning("%s has no effect without enable_lora (--enable-lora)", name)

    def _lora_config(self) -> LoRAConfig | None:
        """LoRAConfig when enable_lora, and what adapters cannot be combined with yet."""
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        if not self.enable_lora:
            return None
        for name, given in (("data_parallel_size > 1", self.data_parallel_size > 1),
                            # a tier on disk outlives the adapters' ids, which key their blocks
                            ("kv_offload_dir", self.kv_offload_dir is not None)):
            if given:
                raise ValueError(f"enable_lora does not work with {name} (yet)")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras)

    def _parse_speculative_config(self) -> SpeculativeConfig | None:
        """The explicit speculative_config (None when unset or "off": the default is
        decided with the device, in create_engine_config)."""
        if self.speculative_config == SPECULATION_OFF:
            return None
        try:
            value = _json_argument(self.speculative_config, "speculative_config")
        except ValueError as e:
            raise ValueError(f"{e}; or '{SPECULATION_OFF}' for no speculative decoding") from None
        return None if value is None else SpeculativeConfig.from_dict(value)

    def speculation(self) -> SpeculativeConfig | None:
        """The speculative decoding this engine runs: the explicit config, none for "off",
        else the default for the device and runner."""
        if self.speculative_config is not None:
            return self._speculative
        from pagedserve.model_loader.loader import resolve_device

        return default_speculative_config(resolve_device(self.device).type, self.runner, self.async_scheduling)

    def step_time_target(self) -> float | None:
        """The step-time target this engine runs: max_step_ms as given, none for 0, else
        the default for the device (config.default_max_step_ms)."""
        if self.max_step_ms is not None:
            return self.max_step_ms or None
        from pagedserve.model_loader.loader import resolve_device

        return default_max_step_ms(resolve_device(self.device).type, self.enable_chunked_prefill)

    # ------------------------------------------------------------------ config
    def create_engine_config(self, load_hf_config: bool = True) -> EngineConfig:
        """Build the config tree.  With load_hf_config (the normal case) the model's
        config is read now -- as vLLM does -- so an unknown model or architecture,
        and a max_model_len beyond the model's limit, fail before any weights load;
        max_model_len defaults to the model's limit.  Tests with a stand-in model pass
        False and get max_model_len or 2048."""
        chat_template = read_chat_template(self.chat_template)
        self._warn_lora_flags()
        model_config = ModelConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
            max_model_len=self.max_model_len, load_format=self.load_format, seed=self.seed,
            trust_remote_code=self.trust_remote_code, chat_template=chat_template,
            max_logprobs=self.max_logprobs, generation_config=self.generation_config,
            override_generation_config=self._generation_overrides,
            quantization=self.quantization, quant_activation_bits=self.quant_activation_bits,
            prepack_weights=self.prepack_weights, runner=self.runner, pooler_config=self._pooler,
            limit_mm_per_prompt=self._media[0], allowed_media_domains=self._media[1],
        )
        if load_hf_config:
            from pagedserve.model_loader import load_model_config

            load_model_config(model_config, self.device)
            if model_config.hf_mm_config is not None and self.tensor_parallel_size > 1:
                raise ValueError("tensor_parallel_size > 1: vision-language models run on one process here")
            if model_config.hf_mm_config is None:
                self._warn_image_flags()
        max_model_len = model_config.max_model_len or 2048
        model_config.max_model_len = max_model_len
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = _DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                batched = max(batched, max_model_len)
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:  # (the scheduler drops it)
            logger.warning("long_prefill_token_threshold has no effect without chunked prefill "
                           "(--no-enable-chunked-prefill is set): a prompt is prefilled whole")
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                kv_cache_memory_ceiling=self.kv_cache_memory_ceiling,
                gpu_memory_utilization=float(self.gpu_memory_utilization),
                cpu_kv_cache_space=envs.cpu_kv_cache_space(),
                num_blocks=self.num_gpu_blocks_override, kv_offload_dir=self.kv_offload_dir,
                kv_offload_bytes=self.kv_offload_bytes, prefix_caching_algo=self.prefix_caching_algo,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched, max_model_len=max_model_len,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                enable_chunked_prefill=self.enable_chunked_prefill, policy=self.scheduling_policy,
                async_scheduling=self.async_scheduling, max_n=self.max_n, max_step_ms=self.step_time_target(),
                preemption_mode=self.preemption_mode, disable_chunked_mm_input=self.disable_chunked_mm_input,
                encoder_cache_size=self.encoder_cache_size,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                           data_parallel_size=self.data_parallel_size, ray_address=self.ray_address,
                                           cpus_per_replica=self.cpus_per_replica),
            device_config=DeviceConfig(
                device=self.device, enforce_eager=self.enforce_eager, attention_backend=self.attention_backend,
                exact_prompt_attention=self.exact_prompt_attention,
                torch_compile=self.torch_compile if self.torch_compile is not None else envs.torch_compile(),
            ),
            structured_outputs_config=StructuredOutputsConfig(backend=self.structured_outputs_backend),
            speculative_config=self.speculation(),
            router_config=self.router_config(),
            lora_config=self._lora,
        )

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """Add one flag per field.  Defaults are None ("not given") so from_cli_args
        passes only what the user typed and EngineArgs keeps its own defaults."""
        group = parser.add_argument_group("engine arguments")
        for f in fields(EngineArgs):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            aliases = _SHORT_FLAGS.get(f.name, ())
            default = f.default
            help_text = HELP.get(f.name, "") + (f" (default: {default})" if default is not None else "")
            if isinstance(default, bool) or f.name in _OPTIONAL_BOOLS:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            elif f.name in ("kv_cache_memory_bytes", "kv_cache_memory_ceiling", "kv_offload_bytes"):
                group.add_argument(flag, type=str, default=None, metavar="BYTES", help=help_text)
            else:
                kind = int if isinstance(default, int) or f.name in _INT_FIELDS else (
                    float if isinstance(default, float) or f.name in _FLOAT_FIELDS else str)
                choices = {"dtype": DTYPES, "load_format": LOAD_FORMATS,
                           "structured_outputs_backend": STRUCTURED_OUTPUT_BACKENDS,
                           "quantization": QUANTIZATION_METHODS, "quant_activation_bits": QUANT_ACTIVATION_BITS,
                           "preemption_mode": PREEMPTION_MODES,
                           "prefix_caching_algo": PREFIX_CACHING_ALGOS, "router_policy": ROUTER_POLICIES,
                           "runner": RUNNERS, "kv_cache_dtype": KV_CACHE_DTYPES}.get(f.name)
                kind = readable_int if f.name in _READABLE_INTS else kind
                group.add_argument(flag, *aliases, type=kind, default=None, choices=choices, help=help_text)
        add_vllm_flags(parser)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
        kwargs = {f.name: getattr(ns, f.name) for f in fields(cls) if getattr(ns, f.name, None) is not None}
        kwargs.update(vllm_flags_given(ns))
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_kwargs("the command line", **kwargs)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    def without_lora(self, **changes: Any) -> EngineArgs:
        """These arguments with no adapters (a draft model's: the adapters are the target's),
        their sizes at the defaults too, so that none is warned of as given without them."""
        return self.replace(enable_lora=False, **{n: EngineArgs.__dataclass_fields__[n].default for n in _LORA_SIZES},
                            **changes)


_LORA_SIZES = ("max_loras", "max_lora_rank", "max_cpu_loras")  # what enable_lora sizes


_OPTIONAL_BOOLS = {"async_scheduling", "torch_compile"}  # None = decided later; --flag / --no-flag
# Other spellings: vLLM's short ones, and its current and older names for ours.
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "data_parallel_size": ("-dp",), "quantization": ("-q",),
                "structured_outputs_backend": ("--structured-outputs-config.backend", "--guided-decoding-backend")}
_FLOAT_FIELDS = {"max_step_ms", "router_cache_threshold", "router_balance_rel_threshold"}
_INT_FIELDS = {"max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "cpus_per_replica",
               "router_balance_abs_threshold", "max_cpu_loras", "encoder_cache_size"}
# Token counts the command line takes as vLLM does: "2k" (2,000), "2K" (2,048), "1.5m".
_READABLE_INTS = {"max_model_len", "max_num_batched_tokens"}


def readable_int(text: str) -> int:
    """An integer, or one with a suffix as vLLM's command line reads it (utils.readable_number)."""
    n = readable_number(text)  # (a negative one: named by the check)
    if n is None:
        raise argparse.ArgumentTypeError(f"{text!r:.40} is not a whole number (suffixes: k, m, g for thousands, "
                                         "K, M, G for powers of 1024, e.g. 2k or 32K)")
    return n


def _generation_overrides(generation_config: Any, overrides: Any) -> dict[str, Any]:
    """generation_config checked ("auto", "vllm" or a directory holding a readable
    generation_config.json), and override_generation_config's sampling defaults, each
    key one of the generation config's sampling keys and its value in SamplingParams' range."""
    from pagedserve.config import GENERATION_CONFIG_KEYS, generation_defaults
    from pagedserve.sampling_params import SamplingParams

    if generation_config not in ("auto", "vllm"):
        file = os.path.join(generation_config, "generation_config.json") if isinstance(generation_config, str) else ""
        try:
            with open(file, encoding="utf-8") as f:
                if not isinstance(json.load(f), dict):
                    raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding a readable "
                             f"generation_config.json, got {generation_config!r:.200} ({e})") from None
    values = _json_argument(overrides, "override_generation_config") or {}
    if not isinstance(values, dict):
        raise ValueError(f"override_generation_config must be a JSON object, got {values!r:.80}")
    if unknown := sorted(set(values) - set(GENERATION_CONFIG_KEYS)):
        raise ValueError(f"override_generation_config: {', '.join(map(repr, unknown))[:200]} set no sampling "
                         f"default (keys: {', '.join(GENERATION_CONFIG_KEYS)})")
    defaults = generation_defaults(values)
    if len(defaults) != len(values):
        raise ValueError(f"override_generation_config's values must be numbers (max_new_tokens an integer), got "
                         f"{values!r:.200}")
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"override_generation_config: {e}") from None
    return values


def _json_argument(value: Any, name: str) -> Any:
    """An argument given as a dict, or on the command line as JSON text (None stays None)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} must be a JSON object, got {value!r} ({e.msg})") from None


def read_chat_template(value: str | None) -> str | None:
    """A template given as a path is read here, and either is parsed, so errors name the
    file or the syntax error at start-up."""
    from pagedserve.chat_template import check_template

    if value is None:
        return None
    if "{" in value:
        check_template(value)
        return value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
        check_template(text, f"chat_template {value!r:.200}")
        return text
    raise ValueError(f"chat_template {value!r} is neither a Jinja template nor an existing file")
