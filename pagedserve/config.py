"""One dataclass tree for every knob, built once (by EngineArgs) and passed down.

Nothing below the entrypoints reads environment variables or module globals for
configuration: a component gets the sub-config it needs from this tree.  This
module imports no torch so that `core/` can use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagedserve.pooling_params import POOLING_TYPES
from pagedserve.utils import is_int, is_number

QUANTIZATION_METHODS = ("auto", "none", "gguf", "int8", "int4")
QUANT_ACTIVATION_BITS = (16, 8)  # the first is the default
# What the engine serves (vLLM's --runner): generated text, or one vector or score per
# prompt from its hidden states (embeddings, scoring, reranking).
RUNNERS = ("generate", "pooling")


# KV-cache storage dtypes (vLLM's names), and the other names each goes by.
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", *KV_CACHE_DTYPE_ALIASES)

# The model dtypes, and the other names each goes by (ModelConfig resolves them).
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DTYPES = ("auto", "float32", "bfloat16", "float16", *DTYPE_ALIASES)


@dataclass
class PoolerConfig:
    """How a pooling runner makes one output of a prompt (vLLM's --pooler-config fields).
    `classifier_from_token`: two tokens (negative, positive) whose last-token logits
    score a (query, document) pair, as vLLM serves Qwen3-Reranker; without it, scores
    are the cosine similarity of the two texts' embeddings."""

    pooling_type: str = "LAST"
    normalize: bool = True
    classifier_from_token: list[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {self.normalize!r}")
        tokens = self.classifier_from_token
        if tokens is not None and (not isinstance(tokens, list) or len(tokens) != 2
                                   or not all(isinstance(t, str) and t for t in tokens)):
            raise ValueError("pooler_config.classifier_from_token must be two token strings (negative, positive), "
                             f"e.g. [\"no\", \"yes\"], got {tokens!r}")

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> PoolerConfig:
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
        known = {"pooling_type", "normalize", "classifier_from_token"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown field(s) {', '.join(unknown)}; it takes {', '.join(sorted(known))}")
        return cls(**value)


@dataclass
class ModelConfig:
    """What to load and how. `hf_config` is filled in by the loader."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    max_model_len: int | None = None  # None: the model's own limit
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    seed: int = 0
    trust_remote_code: bool = False
    chat_template: str | None = None
    # Most top logprobs a request may ask for (vLLM's name and default; OpenAI's chat limit).
    max_logprobs: int = 20
    # "auto": sampling defaults from the model's generation_config.json (for what a request
    # leaves unset); "vllm": the built-in defaults (temperature 1, no top-k/p, ...); a
    # directory: the generation_config.json in it.  override_generation_config's values
    # go over those ("vllm": they alone are the defaults), as vLLM's do.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # Weight-only quantization on CPU (layers/quantization.py): "auto" keeps a GGUF's
    # quantized tensors as they are ("gguf") when running on CPU, else "none" (float
    # weights; a GGUF is dequantized); "int8"/"int4" quantize a float checkpoint at load.
    quantization: str = "auto"
    # The bits a quantized layer's activations are rounded to, per block of 32: 16 keeps
    # the dequantized model's answers; 8 (llama.cpp's scheme) is faster on long prompts
    # and changes small models' answers (docs/cpu_quantization.md, "Activations").
    quant_activation_bits: int = QUANT_ACTIVATION_BITS[0]
    # Keep a second, oneDNN-packed copy of each 16-bit linear weight (faster matmuls on
    # CPU, twice the weight memory); False keeps one copy.
    prepack_weights: bool = True
    runner: str = RUNNERS[0]
    pooler_config: PoolerConfig | None = None  # the pooling runner's (default PoolerConfig())
    hf_config: Any = None  # transformers.PretrainedConfig once resolved (a vision model's: its text config)
    # The file or folder the model resolved to (a Hub id's snapshot folder): its files' identity
    # keys a disk tier's KV blocks (new weights under the same name are another model).
    source_path: str | None = None
    # A vision-language checkpoint's whole config (text_config, vision_config, ...), else None.
    hf_mm_config: Any = None
    # Image input (vLLM's names): most images one prompt may carry ({"image": N}), and the
    # domains whose http(s) image URLs the server may fetch (None: data: URLs only).
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8})
    allowed_media_domains: list[str] | None = None
    # generation_config.json next to the weights, as read at load ({} when there is none).
    generation_config_values: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.pooler_config is not None and self.runner != "pooling":
            raise ValueError("pooler_config configures the pooling runner: set runner='pooling' (--runner pooling)")
        if self.runner == "pooling" and self.pooler_config is None:
            self.pooler_config = PoolerConfig()
        if (not isinstance(self.limit_mm_per_prompt, dict) or set(self.limit_mm_per_prompt) - {"image"}
                or not all(is_int(v) and v >= 0 for v in self.limit_mm_per_prompt.values())):
            raise ValueError("limit_mm_per_prompt takes {\"image\": N} with N >= 0 (images are the one modality "
                             f"here), got {self.limit_mm_per_prompt!r}")
        if self.allowed_media_domains is not None and not (
                isinstance(self.allowed_media_domains, list)
                and all(isinstance(d, str) and d.strip(". ") for d in self.allowed_media_domains)):
            raise ValueError(f"allowed_media_domains must be a list of domain names, got {self.allowed_media_domains!r}")
        if not is_int(self.quant_activation_bits) or self.quant_activation_bits not in QUANT_ACTIVATION_BITS:
            raise ValueError(f"quant_activation_bits must be one of {', '.join(map(str, QUANT_ACTIVATION_BITS))}, "
                             f"got {self.quant_activation_bits!r}")

    def sampling_defaults(self) -> dict[str, Any]:
        """SamplingParams defaults from the generation config and its overrides."""
        values = {} if self.generation_config == "vllm" else dict(self.generation_config_values)
        return generation_defaults({**values, **self.override_generation_config})


# The generation config's keys that set sampling defaults (vLLM's mapping), and their
# SamplingParams names.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams defaults from a generation config's values (others are not sampling's)."""
    return {name: values[key] for key, name in GENERATION_CONFIG_KEYS.items()
            if is_number(values.get(key)) and (key != "max_new_tokens" or isinstance(values[key], int))}


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    # Unset kv_cache_memory_bytes: at most these bytes (in place of the share of free memory,
    # and still capped at what max_num_seqs x max_model_len can use).
    kv_cache_memory_ceiling: int | None = None
    # When kv_cache_memory_bytes is unset, on CUDA: the fraction of total device memory the
    # engine may use (the KV cache gets what weights and peak activations leave); on CPU:
    # the fraction of available memory the KV cache may take (worker/kv_cache.py).
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_fraction: float = 0.25
    # On CPU, bytes in place of cpu_kv_cache_fraction of available memory (still capped at
    # what max_num_seqs x max_model_len could use): $PAGEDSERVE_CPU_KV_CACHE_SPACE.
    cpu_kv_cache_space: int | None = None
    num_blocks: int | None = None  # resolved at start-up
    # Each KV-cache group's sliding window (None: full attention), resolved at start-up
    # with num_blocks from the model's attention layers (worker/kv_cache.py).
    group_windows: tuple[int | None, ...] = (None,)
    # The KV tier beneath the pool (core/kv_tier.py, worker/kv_offload.py): a directory
    # that outlives the process, bounded by kv_offload_bytes (default 8 GiB); or, with
    # only kv_offload_bytes, host memory.
    kv_offload_dir: str | None = None
    kv_offload_bytes: int | None = None
    # "hash": whole blocks by their chained hash; "radix": then, token by token, part of
    # the next block copied from a cached one (core/radix_index.py).
    prefix_caching_algo: str = "hash"
    # What the KV cache stores (vLLM's --kv-cache-dtype): "auto" is the model's dtype;
    # bfloat16/float16 halve float32's bytes, fp8 (e4m3; or e5m2) and int8 (a scale per
    # token and head) quarter them, the attention still computing in the model's dtype
    # (attention/kv_dtype.py).
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")
        self.cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.cache_dtype, self.cache_dtype)


SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
PREFIX_CACHING_ALGOS = ("hash", "radix")
# Of the machine's memory, the most a host-memory KV tier may be given (vLLM refuses swap
# space past the same share): it fills as prefixes are computed, beside the KV cache.
MAX_HOST_TIER_SHARE = 0.7


@dataclass
class SchedulerConfig:
    """Token and sequence budgets for one engine step (vLLM v1 names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"
    # "recompute": a preempted request's KV is freed and recomputed on resumption (what
    # the caches lack); "swap": it is copied to the KV tier first and loaded back.
    preemption_mode: str = "recompute"
    # Most sequences one request may ask for (n): each is a scheduler request of its own.
    max_n: int = 16
    # Overlap scheduling: prepare step N+1 while step N runs; None = on for CUDA (the
    # engine resolves it once it knows the device).
    async_scheduling: bool | None = None
    # A target for one step's duration in milliseconds (core/step_budget.py): the token
    # budget shrinks to what the measured per-token cost fits in it, so decodes keep
    # flowing while long prompts prefill in chunks.  None: the token budget alone (EngineArgs
    # resolves an unset value with the device: default_max_step_ms).
    max_step_ms: float | None = None
    # Image input (vLLM's names): never split an image's span across prefill chunks (the
    # engine sets it for families whose image tokens attend both ways, Gemma 3); the
    # room for vision-encoder outputs, in embedding rows (None: encoder_cache_rows's default).
    disable_chunked_mm_input: bool = False
    encoder_cache_size: int | None = None

    @property
    def encoder_cache_rows(self) -> int:
        """The encoder cache's room in rows, which is also what one step may encode: the
        set size, else max_num_batched_tokens but at least 8192 (a few large images: a
        step's token budget can be smaller than one image's rows, which may still run
        over several chunks)."""
        return self.encoder_cache_size or max(self.max_num_batched_tokens, 8192)

    def __post_init__(self) -> None:
        if self.encoder_cache_size is not None and (not is_int(self.encoder_cache_size) or self.encoder_cache_size < 1):
            raise ValueError(f"encoder_cache_size must be a positive number of rows, got {self.encoder_cache_size!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_n"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not is_int(self.long_prefill_token_threshold) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        if self.policy not in SCHEDULING_POLICIES:  # (EngineArgs' scheduling_policy, vLLM's name)
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_step_ms is not None and not (is_number(self.max_step_ms) and 0 < self.max_step_ms < math.inf):
            raise ValueError(f"max_step_ms must be a finite positive number of milliseconds or None, got {self.max_step_ms!r}")
        if self.max_step_ms is not None and not self.enable_chunked_prefill:
            raise ValueError("max_step_ms needs chunked prefill (a step's time is bounded by chunking prompts)")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is disabled "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_backend: str | None = None  # None: gloo on CPU, nccl on CUDA
    # Engine replicas, each a Ray actor holding a whole engine (engine/data_parallel.py);
    # 1 runs the engine in this process and needs no Ray.
    data_parallel_size: int = 1
    ray_address: str | None = None  # None: start a local Ray; "auto" or "HOST:PORT": join that cluster
    cpus_per_replica: int | None = None  # None: this machine's cores / data_parallel_size (at least 1)


ROUTER_POLICIES = ("round_robin", "least_loaded", "cache_aware")


@dataclass
class RouterConfig:
    """How the data-parallel front end picks a replica for each request (engine/router.py).

    cache_aware sends a request to the replica whose prefix index matches most of its
    prompt, when the match covers at least `cache_threshold` of it; otherwise, and
    whenever the loads are imbalanced (the busiest replica's load exceeds the idlest's by
    more than `balance_abs_threshold` AND by more than `balance_rel_threshold` times), to
    the least loaded one.  Load is vLLM's: waiting x 4 + running."""

    policy: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}")
        if not is_number(self.cache_threshold) or not (
                0.0 <= self.cache_threshold <= 1.0):
            raise ValueError(f"router_cache_threshold must be in [0, 1], got {self.cache_threshold!r}")
        if not is_int(self.balance_abs_threshold) or (
                self.balance_abs_threshold < 0):
            raise ValueError(f"router_balance_abs_threshold must be an integer >= 0, got {self.balance_abs_threshold!r}")
        if not is_number(self.balance_rel_threshold) or not 1.0 <= self.balance_rel_threshold < math.inf:
            raise ValueError(f"router_balance_rel_threshold must be a finite number >= 1, got "
                             f"{self.balance_rel_threshold!r}")


@dataclass
class DeviceConfig:
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    enforce_eager: bool = False
    # torch.compile the model (worker/compiled_model.py); None = on for CPU at tp 1 unless enforce_eager,
    # or unless every decoder layer runs as direct fused-kernel calls (ModelRunner.initialize_kv_cache).
    torch_compile: bool | None = None
    attention_backend: str | None = None  # None: best for the device
    # Every prompt row attended as a one-token decode step computes it, where the backend
    # can (AttentionBackend.exact_rows_context): answers then do not depend on chunking,
    # batching or prefix-cache hits.  False: prompt rows take the blocked paths (an A/B
    # switch; attention/cpu_paged.py measured them slower).
    exact_prompt_attention: bool = True


STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    # The grammar library: "auto" (llguidance: structured_output/backend_types.py says
    # why), "guidance" or "xgrammar".
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, "
                             f"got {self.backend!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Most drafts per request per step: 1 + k tokens of a request must stay within what the
# CPU attention computes as one-token rows (attention/torch_paged.py), so that greedy
# speculation is exact.
MAX_SPECULATIVE_TOKENS = 15
# Longest n-gram prompt lookup tries: each length is one search of the whole sequence per
# drafting request per step, so the bound keeps that work a few searches, not thousands.
MAX_PROMPT_LOOKUP = 32
_SPECULATIVE_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                       "disable_by_batch_size", "model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` names).  "ngram" (prompt lookup)
    drafts by finding the sequence's last n tokens earlier in it and proposing what
    followed (core/ngram_proposer.py); "draft_model" (chosen by giving `model`) lets a
    small model that shares the target's tokenizer propose them greedily
    (worker/draft_model.py).  The target verifies all drafts in one forward
    (worker/rejection_sampler.py)."""

    method: str | None = None  # None: "draft_model" when `model` is given, else "ngram"
    # Most drafts per request per step; 8 measured best on the edit-code workload (docs/performance.md).
    num_speculative_tokens: int = 8
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up
    prompt_lookup_min: int = 2  # shortest one that still counts as a match
    # Draft only while at most this many requests run: verifying drafts costs compute,
    # which a large batch no longer has to spare (docs/performance.md gives the measurement).
    disable_by_batch_size: int = 4
    model: str | None = None  # the draft model (method "draft_model"): whatever LLM(...) takes

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model: method 'draft_model' needs the draft model "
                             f"(a registry name, an HF directory or a .gguf file), got {self.model!r}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is for method 'draft_model'; method 'ngram' drafts "
                             "from the sequence itself (leave out model, or method)")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_max > MAX_PROMPT_LOOKUP:
            raise ValueError(f"speculative_config.prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, "
                             f"got {self.prompt_lookup_max}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_dict(cls, values: object) -> SpeculativeConfig:
        """From `LLM(speculative_config={...})` or `--speculative-config '{...}'`."""
        if isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(values).__name__}")
        unknown = sorted(set(values) - set(_SPECULATIVE_FIELDS))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(_SPECULATIVE_FIELDS)}")
        return cls(**values)


# speculative_config="off" (--speculative-config off): no speculation, not even the default.
SPECULATION_OFF = "off"


def default_speculative_config(device_type: str, runner: str, async_scheduling: bool | None) -> SpeculativeConfig | None:
    """What an unset speculative_config means: n-gram drafts (SpeculativeConfig's defaults)
    on CPU for the generate runner, unless overlap scheduling was asked for (the two do
    not combine).  Why on by default there: a CPU decode step of a few requests costs about
    the same for 1 token as for 9, so drafts that are accepted are nearly free tokens, and
    `disable_by_batch_size` stops drafting once the batch is big enough to use the compute.
    Exact: greedy outputs are those of one token at a time, and sampled ones are too
    (worker/rejection_sampler.py).  Measured side by side (docs/performance.md): faster on
    edit-code and chat, the same on a 32-request burst.  On CUDA the default stays off
    (overlap scheduling is on there, and the trade was not measured)."""
    if device_type != "cpu" or runner != "generate" or async_scheduling:
        return None
    return SpeculativeConfig(method="ngram")


# The step-time target an unset max_step_ms means on CPU.  Every running stream waits for
# the whole step, and on 2 CPU cores a step of max_num_batched_tokens prompt tokens takes
# seconds: a cold 2,800-token prompt froze another client's stream for 10.6 s (Zen 3).  At
# 250 ms a long prompt prefills in chunks beside the decodes, each of which then waits
# about that long at most; a prompt with no stream beside it still takes the whole token
# budget (core/scheduler.py).  On CUDA a step of the token budget is milliseconds.
DEFAULT_CPU_MAX_STEP_MS = 250.0


def default_max_step_ms(device_type: str, enable_chunked_prefill: bool) -> float | None:
    """What an unset max_step_ms means: DEFAULT_CPU_MAX_STEP_MS on CPU (with chunked
    prefill, which it works through), else none."""
    return DEFAULT_CPU_MAX_STEP_MS if device_type == "cpu" and enable_chunked_prefill else None


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's --enable-lora knobs; pagedserve/lora/).  `max_loras`:
    adapters resident in the model at once, so at most that many distinct adapters run
    in one step; `max_cpu_loras`: adapters kept loaded in host memory (an LRU; None:
    max_loras); `max_lora_rank`: the largest rank an adapter may have."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if not is_int(self.max_cpu_loras) or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    router_config: RouterConfig = field(default_factory=RouterConfig)  # data parallelism only
    lora_config: LoRAConfig | None = None  # None: no adapters (enable_lora=False)
