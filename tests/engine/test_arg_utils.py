from __future__ import annotations

import argparse

import pytest

from pagedserve.config import SpeculativeConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.utils import parse_bytes


def test_defaults_and_config_tree() -> None:
    args = EngineArgs(max_model_len=512, block_size=32, enable_prefix_caching=False, seed=3,
                      long_prefill_token_threshold=64, kv_cache_memory_bytes="1MiB", dtype="bf16")
    cfg = args.create_engine_config(load_hf_config=False)
    assert cfg.model_config.model == "smollm2-135m-instruct" and cfg.model_config.dtype == "bfloat16"
    assert cfg.model_config.seed == 3 and cfg.model_config.max_model_len == 512
    assert (cfg.cache_config.block_size, cfg.cache_config.enable_prefix_caching) == (32, False)
    assert cfg.cache_config.kv_cache_memory_bytes == 2**20
    s = cfg.scheduler_config
    assert (s.max_model_len, s.max_num_batched_tokens, s.long_prefill_token_threshold) == (512, 8192, 64)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"dtype": "float64"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"block_size": 24}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"block_size": 512}, "block_size must be a power of two from 1 to 256"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization"),  # (was taken as 1.0)
        ({"kv_cache_memory_bytes": "lots"}, "kv_cache_memory_bytes"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"load_format": "pickle"}, "load_format"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"model": ""}, "model"),
        ({"chat_template": "/no/such/template.jinja"}, "chat_template"),
    ],
)
def test_bad_values_name_the_argument(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        EngineArgs(**kwargs).create_engine_config(load_hf_config=False)


def test_unknown_kwargs_are_a_type_error_naming_them() -> None:
    with pytest.raises(TypeError, match="max_len, speed.*Valid engine arguments: .*max_model_len"):
        EngineArgs.from_kwargs("LLM()", model="m", max_len=3, speed=1)


def test_chat_template_from_file(tmp_path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages }}")
    cfg = EngineArgs(chat_template=str(f)).create_engine_config(load_hf_config=False)
    assert cfg.model_config.chat_template == "{{ messages }}"


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1.5k") == 1500 and parse_bytes(4096) == 4096
    # vLLM's human_readable_int: an upper-case letter is binary ("1G" was 10^9 here), lower-case decimal
    assert parse_bytes("1G") == 2**30 and parse_bytes("512M") == 512 * 2**20 and parse_bytes("1g") == 10**9
    with pytest.raises(ValueError, match="K, M, G: of 1024, whole numbers"):
        parse_bytes("1.5G")
    with pytest.raises(ValueError):
        parse_bytes("12 parsecs")


def test_cli_flags_round_trip() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", "x", "--max-model-len", "256", "--no-enable-prefix-caching",
                            "--kv-cache-memory-bytes", "64MiB", "--dtype", "float32", "--enforce-eager"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.model, args.max_model_len, args.enable_prefix_caching) == ("x", 256, False)
    assert args.kv_cache_memory_bytes == 64 * 2**20 and args.dtype == "float32" and args.enforce_eager
    # Flags not given keep the dataclass defaults.
    untouched = EngineArgs.from_cli_args(parser.parse_args([]))
    assert untouched == EngineArgs()
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int3"])
    assert untouched.quant_activation_bits == 16
    assert EngineArgs.from_cli_args(parser.parse_args(["--quant-activation-bits", "8"])).quant_activation_bits == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--quant-activation-bits", "4"])


def test_the_namespace_of_add_cli_args_builds_an_llm_as_vllms_examples_do() -> None:
    """vLLM's example scripts call LLM(**vars(args)) after EngineArgs.add_cli_args: every
    flag left unset comes as None (it was "device must be 'auto', ... got None")."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", "x", "--max-model-len", "256", "--seed", "3"])
    assert EngineArgs.from_kwargs("LLM()", **vars(ns)) == EngineArgs.from_cli_args(ns)


def test_speculative_config_from_the_command_line_and_from_a_dict() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    cfg = EngineArgs.from_cli_args(ns).create_engine_config(load_hf_config=False)
    assert cfg.speculative_config.method == "ngram" and cfg.speculative_config.num_speculative_tokens == 3
    cfg = EngineArgs(speculative_config={"prompt_lookup_max": 5}).create_engine_config(load_hf_config=False)
    assert (cfg.speculative_config.prompt_lookup_max, cfg.speculative_config.num_speculative_tokens) == (5, 8)
    with pytest.raises(ValueError, match="JSON object"):
        EngineArgs(speculative_config="ngram")
    with pytest.raises(ValueError, match="unknown field"):
        EngineArgs(speculative_config={"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(speculative_config={}, async_scheduling=True)


def test_speculation_by_default_on_cpu_only_and_off_on_request() -> None:
    """Unset: n-gram drafts with SpeculativeConfig's defaults on CPU for the generate
    runner; none on CUDA, for the pooling runner, or beside async_scheduling=True (which it
    does not combine with); "off" (--speculative-config off) turns the default off."""
    def spec(**kw):
        return EngineArgs(**kw).create_engine_config(load_hf_config=False).speculative_config

    assert spec(device="cpu") == SpeculativeConfig(method="ngram")
    assert spec(device="cpu", speculative_config="off") is None
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--device", "cpu", "--speculative-config", "off"])
    assert EngineArgs.from_cli_args(ns).create_engine_config(load_hf_config=False).speculative_config is None
    assert spec(device="cuda") is None
    assert spec(device="cpu", async_scheduling=True) is None
    assert spec(device="cpu", runner="pooling") is None
    EngineArgs(runner="pooling", speculative_config="off")  # "off" is not a speculative config to refuse
    with pytest.raises(ValueError, match="runner='pooling' does not work with speculative_config"):
        EngineArgs(runner="pooling", speculative_config={})


def test_kv_tier_flags_reach_the_config_tree() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--kv-offload-dir", "/tmp/kv", "--kv-offload-bytes", "2GiB", "--preemption-mode", "swap",
                            "--prefix-caching-algo", "radix"])
    cfg = EngineArgs.from_cli_args(ns).create_engine_config(load_hf_config=False)
    cache = cfg.cache_config
    assert (cache.kv_offload_dir, cache.kv_offload_bytes, cache.prefix_caching_algo) == ("/tmp/kv", 2 * 2**30, "radix")
    assert cfg.scheduler_config.preemption_mode == "swap"
    with pytest.raises(SystemExit):
        parser.parse_args(["--preemption-mode", "discard"])


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(preemption_mode="drop"), "preemption_mode must be 'recompute' or 'swap'"),
    (dict(prefix_caching_algo="trie"), "prefix_caching_algo must be 'hash' or 'radix'"),
    (dict(prefix_caching_algo="radix", enable_prefix_caching=False), "radix.*needs enable_prefix_caching"),
    (dict(kv_offload_dir="/tmp/kv", enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(kv_offload_bytes="lots"), "kv_offload_bytes"),
    # (a host tier past 70% of memory grew until the system ran out of it)
    (dict(kv_offload_bytes="99999999999999999999999999"), r"kv_offload_bytes .* more than 70% of this machine"),
    (dict(kv_offload_bytes="100TiB", preemption_mode="swap"), r"kv_offload_bytes .* more than 70%"),
    (dict(kv_offload_dir=""), "kv_offload_dir must be a directory path"),
    (dict(kv_offload_dir="/tmp/kv", tensor_parallel_size=2), "not work under tensor parallelism"),
    (dict(preemption_mode="swap", tensor_parallel_size=2), "preemption_mode='swap'.*tensor parallelism"),
])
def test_kv_tier_settings_that_cannot_work_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_a_kv_offload_dir_that_is_a_file_is_refused(tmp_path) -> None:
    """A path there but no directory is a mistake of the command line: the tier turned
    itself off with a warning and the run went on (a missing folder is still made)."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=f"kv_offload_dir '{tmp_path / 'file'}' is not a directory"):
        EngineArgs(kv_offload_dir=str(tmp_path / "file"))
    EngineArgs(kv_offload_dir=str(tmp_path / "new"))


def test_swap_without_prefix_caching_is_allowed() -> None:
    cfg = EngineArgs(preemption_mode="swap", enable_prefix_caching=False).create_engine_config(load_hf_config=False)
    assert cfg.scheduler_config.preemption_mode == "swap" and cfg.cache_config.kv_offload_dir is None


def test_data_parallel_flags_reach_the_config_tree_and_each_replica_gets_one_engine() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["-dp", "3", "--ray-address", "10.0.0.1:6379", "--cpus-per-replica", "4",
                            "--router-policy", "least_loaded", "--router-cache-threshold", "0.25",
                            "--router-balance-abs-threshold", "8", "--router-balance-rel-threshold", "2",
                            "--kv-offload-dir", "/tmp/kv"])
    args = EngineArgs.from_cli_args(ns)
    cfg = args.create_engine_config(load_hf_config=False)
    par, router = cfg.parallel_config, cfg.router_config
    assert (par.data_parallel_size, par.ray_address, par.cpus_per_replica) == (3, "10.0.0.1:6379", 4)
    assert (router.policy, router.cache_threshold, router.balance_abs_threshold,
            router.balance_rel_threshold) == ("least_loaded", 0.25, 8, 2.0)
    replica = args.for_replica(2)
    assert replica.data_parallel_size == 1 and replica.ray_address is None and replica.router_policy is None
    assert replica.kv_offload_dir == "/tmp/kv/replica-2"  # two engines never share one tier directory
    assert EngineArgs(data_parallel_size=2).router_config().policy == "cache_aware"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(data_parallel_size=0), "data_parallel_size must be a positive integer"),
    (dict(ray_address="auto"), "ray_address: only data-parallel replicas use this"),
    (dict(router_policy="cache_aware"), "router_policy: only data-parallel replicas"),
    (dict(data_parallel_size=2, router_policy="random"), "router_policy must be one of"),
    (dict(data_parallel_size=2, router_cache_threshold=1.5), r"router_cache_threshold must be in \[0, 1\]"),
    (dict(data_parallel_size=2, router_balance_abs_threshold=-1), "router_balance_abs_threshold"),
    (dict(data_parallel_size=2, router_balance_rel_threshold=0.5), "router_balance_rel_threshold must be"),
    # (NaN compared false everywhere: balancing was off, silently)
    (dict(data_parallel_size=2, router_balance_rel_threshold=float("nan")), "router_balance_rel_threshold must be"),
    (dict(data_parallel_size=2, ray_address="ray://head:10001"), "ray_address must be 'auto' or HOST:PORT"),
    (dict(data_parallel_size=2, cpus_per_replica=0), "cpus_per_replica must be a positive integer"),
])
def test_data_parallel_settings_that_cannot_work_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_a_cuda_device_where_there_is_none_is_refused_by_name(monkeypatch) -> None:
    """--device cuda on a machine without CUDA: one line naming it (it failed in a model
    constructor with torch's assertion)."""
    import torch

    from pagedserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:7"):
        with pytest.raises(ValueError, match=f"device '{device}': no CUDA device is available here"):
            LLMEngine.from_engine_args(EngineArgs(model="/nonexistent", device=device))


def test_one_engine_refuses_replicas() -> None:
    from pagedserve.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="cannot hold 2 data-parallel replicas"):
        LLMEngine.from_engine_args(EngineArgs(data_parallel_size=2))


# Where each engine argument is checked: one place each (the issue of one rule in one
# place).  A field whose config class owns it is checked there, when the config tree is
# built; EngineArgs checks only what it reads before that, or what has no config of its
# own.  Each row: a bad value (with what else it needs) and the function that refuses it.
_V = "EngineArgs._validate"
_SIZES = "EngineArgs._validate_model_and_sizes"
_SCALARS = "EngineArgs._validate_scalars"
WHERE_CHECKED = {
    "model": ({"model": ""}, _SIZES),
    "tokenizer": ({"tokenizer": 3}, _SIZES),
    "dtype": ({"dtype": "float64"}, "ModelConfig.__post_init__"),
    "device": ({"device": "tpu"}, _SIZES),
    "max_model_len": ({"max_model_len": 0}, "ModelConfig.__post_init__"),
    "max_num_seqs": ({"max_num_seqs": -1}, "SchedulerConfig.__post_init__"),
    "max_num_batched_tokens": ({"max_num_batched_tokens": 0}, _SIZES),
    "block_size": ({"block_size": 24}, _SIZES),
    "enable_prefix_caching": ({"enable_prefix_caching": "yes"}, _SCALARS),
    "long_prefill_token_threshold": ({"long_prefill_token_threshold": -1}, "SchedulerConfig.__post_init__"),
    "kv_cache_memory_bytes": ({"kv_cache_memory_bytes": "lots"}, "parse_bytes"),
    "kv_cache_memory_ceiling": ({"kv_cache_memory_ceiling": 0}, "parse_bytes"),
    "gpu_memory_utilization": ({"gpu_memory_utilization": 1.5}, _SCALARS),
    "num_gpu_blocks_override": ({"num_gpu_blocks_override": 0}, _SIZES),
    "prefix_caching_algo": ({"prefix_caching_algo": "trie"}, "EngineArgs._validate_kv_tier"),
    "kv_offload_dir": ({"kv_offload_dir": ""}, "EngineArgs._validate_kv_tier"),
    "kv_offload_bytes": ({"kv_offload_bytes": "lots"}, "parse_bytes"),
    "preemption_mode": ({"preemption_mode": "drop"}, "EngineArgs._validate_kv_tier"),
    "seed": ({"seed": "x"}, _SCALARS),
    "max_logprobs": ({"max_logprobs": -1}, _SCALARS),
    "max_n": ({"max_n": 0}, "SchedulerConfig.__post_init__"),
    "generation_config": ({"generation_config": "hf"}, "_generation_overrides"),
    "override_generation_config": ({"override_generation_config": {"top_k": -2}}, "_generation_overrides"),
    "load_format": ({"load_format": "pickle"}, _SCALARS),
    "enforce_eager": ({"enforce_eager": 1}, _SCALARS),
    "tensor_parallel_size": ({"tensor_parallel_size": 0}, _SIZES),
    "data_parallel_size": ({"data_parallel_size": 0}, _SIZES),
    "ray_address": ({"data_parallel_size": 2, "ray_address": "nowhere"}, "EngineArgs._validate_data_parallel"),
    "cpus_per_replica": ({"data_parallel_size": 2, "cpus_per_replica": 0}, "EngineArgs._validate_data_parallel"),
    "router_policy": ({"data_parallel_size": 2, "router_policy": "random"}, "RouterConfig.__post_init__"),
    "router_cache_threshold": ({"data_parallel_size": 2, "router_cache_threshold": 2.0},
                               "RouterConfig.__post_init__"),
    "router_balance_abs_threshold": ({"data_parallel_size": 2, "router_balance_abs_threshold": -1},
                                     "RouterConfig.__post_init__"),
    "router_balance_rel_threshold": ({"data_parallel_size": 2, "router_balance_rel_threshold": True},
                                     "RouterConfig.__post_init__"),
    "chat_template": ({"chat_template": 3}, _V),
    "attention_backend": ({"attention_backend": 3}, _V),
    "exact_prompt_attention": ({"exact_prompt_attention": "yes"}, _SCALARS),
    "enable_chunked_prefill": ({"enable_chunked_prefill": "no"}, _SCALARS),
    "scheduling_policy": ({"scheduling_policy": "lifo"}, "SchedulerConfig.__post_init__"),
    "trust_remote_code": ({"trust_remote_code": "no"}, _SCALARS),
    "async_scheduling": ({"async_scheduling": "on"}, _SCALARS),
    "torch_compile": ({"torch_compile": "yes"}, _SCALARS),
    "structured_outputs_backend": ({"structured_outputs_backend": "regex"}, "StructuredOutputsConfig.__post_init__"),
    "quantization": ({"quantization": "fp4"}, "ModelConfig.__post_init__"),
    "quant_activation_bits": ({"quant_activation_bits": 4}, "ModelConfig.__post_init__"),
    "prepack_weights": ({"prepack_weights": "x"}, _SCALARS),
    "max_step_ms": ({"max_step_ms": True}, "SchedulerConfig.__post_init__"),
    "speculative_config": ({"speculative_config": {"method": "medusa"}}, "SpeculativeConfig.__post_init__"),
    "runner": ({"runner": "embed"}, "ModelConfig.__post_init__"),
    "kv_cache_dtype": ({"kv_cache_dtype": "int4"}, "CacheConfig.__post_init__"),
    "pooler_config": ({"runner": "pooling", "pooler_config": {"pooling_type": "MAX"}}, "PoolerConfig.__post_init__"),
    "enable_lora": ({"enable_lora": "yes"}, "EngineArgs._lora_config"),
    "max_loras": ({"enable_lora": True, "max_loras": 0}, "LoRAConfig.__post_init__"),
    "max_lora_rank": ({"enable_lora": True, "max_lora_rank": 0}, "LoRAConfig.__post_init__"),
    "max_cpu_loras": ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1}, "LoRAConfig.__post_init__"),
    "limit_mm_per_prompt": ({"limit_mm_per_prompt": {"video": 1}}, "ModelConfig.__post_init__"),
    "allowed_media_domains": ({"allowed_media_domains": [3]}, "ModelConfig.__post_init__"),
    "disable_chunked_mm_input": ({"disable_chunked_mm_input": "yes"}, _SCALARS),
    "encoder_cache_size": ({"encoder_cache_size": 0}, "SchedulerConfig.__post_init__"),
}


def test_every_engine_argument_is_listed_with_where_it_is_checked() -> None:
    from dataclasses import fields

    assert sorted(WHERE_CHECKED) == sorted(f.name for f in fields(EngineArgs))


@pytest.mark.parametrize("name", sorted(WHERE_CHECKED))
def test_each_engine_argument_is_refused_in_its_one_place(name: str) -> None:
    """The refusal names the argument and comes from the function the table names."""
    kwargs, owner = WHERE_CHECKED[name]
    with pytest.raises(ValueError) as info:
        EngineArgs(**kwargs).create_engine_config(load_hf_config=False)
    assert name.removeprefix("router_") in str(info.value) or name in str(info.value), info.value
    tb = info.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_qualname == owner, (name, tb.tb_frame.f_code.co_qualname)


def test_the_step_time_target_defaults_on_for_cpu_and_0_turns_it_off() -> None:
    from pagedserve.config import DEFAULT_CPU_MAX_STEP_MS

    def target(**kw):
        return EngineArgs(model="dummy", device="cpu", **kw).create_engine_config(
            load_hf_config=False).scheduler_config.max_step_ms

    assert target() == DEFAULT_CPU_MAX_STEP_MS
    assert target(max_step_ms=0) is None
    assert target(max_step_ms=80.0) == 80.0
    assert target(enable_chunked_prefill=False, max_num_batched_tokens=4096) is None  # it works through chunks


def test_lora_sizes_without_enable_lora_are_warned_of(caplog) -> None:
    """`generate --max-loras -3` and `LLM(max_lora_rank=64)` without enable_lora change
    nothing; each is named (they passed in silence outside `serve`)."""
    with caplog.at_level("WARNING", logger="pagedserve"):
        # (said once per engine built, not at each EngineArgs made on the way: `generate` said it 4 times)
        EngineArgs(max_loras=-3, max_lora_rank=0).replace(seed=1).replace(seed=2).create_engine_config(
            load_hf_config=False)
        EngineArgs(max_loras=2, enable_lora=True).create_engine_config(load_hf_config=False)
        # a draft model's arguments: the target's without its adapters (the sizes were kept, and
        # a correct --enable-lora --max-loras 8 run warned of them for the draft)
        draft = EngineArgs(max_loras=8, max_lora_rank=32, enable_lora=True).without_lora(seed=3)
        assert (draft.enable_lora, draft.max_loras, draft.max_lora_rank, draft.seed) == (False, 1, 16, 3)
        draft.create_engine_config(load_hf_config=False)
    said = [r.getMessage() for r in caplog.records if "no effect without enable_lora" in r.getMessage()]
    assert said == ["max_loras has no effect without enable_lora (--enable-lora)",
                    "max_lora_rank has no effect without enable_lora (--enable-lora)"]


def test_a_long_prefill_threshold_without_chunked_prefill_is_warned_about(caplog) -> None:
    """The scheduler sets it to 0 without chunked prefill; that was said nowhere."""
    import logging

    with caplog.at_level(logging.WARNING):
        EngineArgs(long_prefill_token_threshold=32).create_engine_config(load_hf_config=False)
        EngineArgs(enable_chunked_prefill=False).create_engine_config(load_hf_config=False)
        assert "long_prefill_token_threshold" not in caplog.text
        EngineArgs(long_prefill_token_threshold=32, enable_chunked_prefill=False).create_engine_config(
            load_hf_config=False)
    assert "long_prefill_token_threshold has no effect without chunked prefill" in caplog.text


def test_image_flags_for_a_model_without_images_are_warned_about(caplog) -> None:
    """A text-only server took --limit-mm-per-prompt in silence."""
    import logging

    with caplog.at_level(logging.WARNING):
        EngineArgs(model="smollm2-135m-instruct").create_engine_config()
        assert "reads no images" not in caplog.text
        EngineArgs(model="smollm2-135m-instruct", limit_mm_per_prompt='{"image": 2}',
                   disable_chunked_mm_input=True).create_engine_config()
    assert [r.getMessage() for r in caplog.records if "reads no images" in r.getMessage()] == [
        "limit_mm_per_prompt has no effect: this model reads no images",
        "disable_chunked_mm_input has no effect: this model reads no images"]


def test_token_counts_take_vllms_suffixes_on_the_command_line() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for text, want in (("2k", 2000), ("1K", 1024), ("25.6k", 25600), ("4096", 4096), ("1M", 2**20), ("1.005k", 1005)):
        assert EngineArgs.from_cli_args(parser.parse_args(["--max-model-len", text])).max_model_len == want
    assert EngineArgs.from_cli_args(parser.parse_args(["--max-num-batched-tokens", "8K"])).max_num_batched_tokens == 8192
    for text in ("1.5K", "2kb", "2.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-model-len", text])
    with pytest.raises(ValueError, match="max_model_len"):  # (a negative one: named by the check)
        EngineArgs.from_cli_args(parser.parse_args(["--max-model-len", "-5"])).create_engine_config(False)


def test_vllms_flags_on_the_command_line_mean_what_its_keywords_do() -> None:
    """`vllm serve` flags were "unrecognized arguments": each is now read as LLM(...)'s
    keyword of that name is (taken, mapped, or refused with the reason)."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(allow_abbrev=False))
    args = EngineArgs.from_cli_args(parser.parse_args([
        "--tokenizer-mode", "auto", "--revision", "main", "-pp", "1", "--swap-space", "4", "--hf-overrides", "{}",
        "--structured-outputs-config", '{"backend": "xgrammar"}', "--disable-custom-all-reduce", "-O3",
        "--logprobs-mode", "raw_logprobs", "--task", "embed"]))
    assert args == EngineArgs(structured_outputs_backend="xgrammar", runner="pooling")
    assert EngineArgs.from_cli_args(parser.parse_args(["-O", "0"])).torch_compile is False
    for flags, match in ((["--skip-tokenizer-init"], "skip_tokenizer_init=True is not supported here"),
                         (["--logprobs-mode", "processed_logits"], "raw_logprobs"),
                         (["--mm-processor-kwargs", '{"num_crops": 4}'], "mm_processor_kwargs="),
                         (["-pp", "2"], "no pipeline parallelism here"),
                         # (a contradiction: the engine's own flag won in silence)
                         (["-O", "0", "--torch-compile"], "compilation_config asks for torch_compile=False, but "
                                                          "torch_compile=True was given too"),
                         (["--structured-outputs-config", '{"backend": "xgrammar"}', "--structured-outputs-backend",
                           "guidance"], "asks for structured_outputs_backend='xgrammar', but"),
                         (["--task", "embed", "--runner", "generate"], "task='embed' asks for runner='pooling'"),
                         # (a credential is named, never shown: it was echoed into the error line)
                         (["--hf-token", "hf_secret"], r"^hf_token=\.\.\. is not supported here")):
        with pytest.raises(ValueError, match=match):
            EngineArgs.from_cli_args(parser.parse_args(flags))
    assert EngineArgs.from_cli_args(parser.parse_args(["-O", "0", "--no-torch-compile"])).torch_compile is False


def test_override_generation_config_and_a_generation_config_directory(tmp_path) -> None:
    def defaults(**kwargs) -> dict:
        return EngineArgs(**kwargs).create_engine_config(load_hf_config=False).model_config.sampling_defaults()

    assert defaults(override_generation_config='{"temperature": 0.2, "max_new_tokens": 9}') == {
        "temperature": 0.2, "max_tokens": 9}
    assert defaults(generation_config="vllm", override_generation_config={"top_k": 5}) == {"top_k": 5}
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9}')
    config = EngineArgs(generation_config=str(tmp_path), override_generation_config={"top_p": 0.5})
    from pagedserve.model_loader.loader import read_generation_config

    model_config = config.create_engine_config(load_hf_config=False).model_config
    model_config.generation_config_values = read_generation_config(str(tmp_path))
    assert model_config.sampling_defaults() == {"temperature": 0.6, "top_p": 0.5}  # the override's wins
    for kwargs, match in (({"override_generation_config": {"seed": 1}}, "'seed' set no sampling default"),
                          ({"override_generation_config": {"temperature": -1}}, "temperature must be"),
                          ({"override_generation_config": "[1]"}, "must be a JSON object"),
                          ({"generation_config": str(tmp_path / "none")}, "a directory holding a readable")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(**kwargs)


def test_a_malformed_chat_template_is_refused_at_start(tmp_path) -> None:
    """It started, and then every chat request was a 400."""
    with pytest.raises(ValueError, match=r"chat_template is not a valid Jinja template \(line 1: unexpected '}'\)"):
        EngineArgs(chat_template="{% for m in messages %}{{ m.content }").create_engine_config(load_hf_config=False)
    (tmp_path / "t.jinja").write_text("{% if x %}\nno end")
    with pytest.raises(ValueError, match="t.jinja.* is not a valid Jinja template"):
        EngineArgs(chat_template=str(tmp_path / "t.jinja")).create_engine_config(load_hf_config=False)


def test_a_torch_dtype_is_taken_as_vllm_takes_it() -> None:
    import torch

    assert EngineArgs.from_kwargs(dtype=torch.bfloat16).dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of .*, got 'int8'"):
        EngineArgs.from_kwargs(dtype=torch.int8).create_engine_config(load_hf_config=False)
