"""Reading PEFT adapters: what is served, every option that changes the math refused by
name, tensors checked against the model from the header before they are read, and
refusals that tell a client nothing about the server's disk or the files' contents."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.lora.peft import NOT_AN_ADAPTER, LoRAAdapterError, read_peft_adapter

PREFIX = "base_model.model.model.layers.0.self_attn"
# The model's adaptable modules, (in, out) features each: what the LoRA manager passes.
SHAPES = {f"model.layers.0.self_attn.{m}": (8, 8) for m in ("q_proj", "k_proj", "v_proj")}


def read(path: str, max_rank: int = 16, shapes: dict | None = None, dtype: torch.dtype = torch.float32):
    return read_peft_adapter(path, max_rank, SHAPES if shapes is None else shapes, dtype)


def write(path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def qv(r: int = 4) -> dict[str, torch.Tensor]:
    return {f"{PREFIX}.{m}.lora_{h}.weight": torch.ones(*((r, 8) if h == "A" else (8, r)))
            for m in ("q_proj", "v_proj") for h in ("A", "B")}


def test_rank_alpha_and_rslora_scaling(tmp_path) -> None:
    adapter = read(write(tmp_path, {"peft_type": "LORA", "r": 4, "lora_alpha": 8}, qv()))
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert set(adapter.weights) == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"}
    rs = read(write(tmp_path, {"r": 4, "lora_alpha": 8, "use_rslora": True}, qv()))
    assert math.isclose(rs.scaling, 4.0)


@pytest.mark.parametrize("option, value", [("use_dora", True), ("bias", "all"), ("fan_in_fan_out", True),
                                           ("modules_to_save", ["lm_head"]), ("rank_pattern", {"q_proj": 8}),
                                           # PEFT's newer options (served as plain LoRA, they gave other
                                           # answers than PEFT's) and one no PEFT has yet
                                           ("alora_invocation_tokens", [300, 400]),
                                           ("layer_replication", [[0, 2], [1, 2]]), ("use_qalora", True),
                                           ("target_parameters", ["mlp.experts.gate_up_proj"]),
                                           ("some_future_option", {"k": 1}), ("some_future_option", 0),
                                           # trained on base weights PiSSA changed (unconverted)
                                           ("init_lora_weights", "pissa_niter_4"), ("init_lora_weights", "loftq")])
def test_options_that_change_the_math_are_refused_by_name(tmp_path, option, value) -> None:
    path = write(tmp_path, {"r": 4, "lora_alpha": 8, option: value}, qv())
    with pytest.raises(LoRAAdapterError, match=f"adapter option {option} is not supported") as info:
        read(path)
    assert repr(value) not in str(info.value)  # a value read from the file is never echoed


@pytest.mark.parametrize("config, tensors, message", [
    ({"peft_type": "IA3", "r": 4}, qv(), "peft_type is not LORA"),
    ({"r": 0}, qv(), "rank r must be a positive integer"),
    ({"r": 4, "lora_alpha": "big"}, qv(), "lora_alpha must be a finite number"),
    ({"r": 2}, qv(4), "not a rank-r LoRA matrix"),
    ({"r": 4}, {f"{PREFIX}.q_proj.lora_A.weight": torch.ones(8, 4), f"{PREFIX}.q_proj.lora_B.weight": torch.ones(8, 4)},
     "not a rank-r LoRA matrix"),
    ({"r": 4}, {f"{PREFIX}.o_proj.lora_A.weight": torch.ones(4, 8), f"{PREFIX}.o_proj.lora_B.weight": torch.ones(8, 4)},
     r"not a linear layer of this model \(adaptable: k_proj, q_proj, v_proj\)"),
    ({"r": 4}, {f"{PREFIX}.q_proj.lora_A.weight": torch.ones(4, 8, dtype=torch.int32),
                f"{PREFIX}.q_proj.lora_B.weight": torch.ones(8, 4)}, "must be floating point"),
    ({"r": 4}, {"base_model.model.lm_head.lora_A.weight": torch.ones(4, 8),
                "base_model.model.lm_head.lora_B.weight": torch.ones(8, 4)}, "embedding or LM head"),
    ({"r": 4}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 8)}, "embedding or LM head"),
    ({"r": 4}, {f"{PREFIX}.q_proj.lora_A.weight": torch.ones(4, 8)}, "does not have both lora_A and lora_B"),
    ({"r": 4}, {f"{PREFIX}.q_proj.weight": torch.ones(8, 8)}, "is not a LoRA weight"),
])
def test_malformed_adapters_are_refused_by_name(tmp_path, config, tensors, message) -> None:
    with pytest.raises(LoRAAdapterError, match=message) as info:
        read(write(tmp_path, config, tensors))
    said = str(info.value)  # no tensor name, shape or path read from the files
    assert not any(w in said for w in ("base_model", "layers.0", str(tmp_path), "(8, 4)", "[8, 4]")), said


def test_missing_unreadable_or_oversized_configs_are_one_message(tmp_path) -> None:
    """A client names the path: a missing directory, a file, a directory without a
    config and one with a config that is not a small JSON object must be told apart by
    nothing, or the refusals map the server's disk."""
    file = tmp_path / "plain-file"
    file.write_text("x")
    (tmp_path / "empty").mkdir()
    configs = {"big": " " * (1 << 20) + "{}", "not-json": '{"r": 4', "list": "[4]", "deep": "[" * 100_000}
    for name, text in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(text)
    for path in [tmp_path / "nowhere", file, tmp_path / "empty", *(tmp_path / name for name in configs)]:
        with pytest.raises(LoRAAdapterError) as info:
            read(str(path))
        assert str(info.value) == NOT_AN_ADAPTER, path
    assert "is not a directory" in NOT_AN_ADAPTER and str(tmp_path) not in NOT_AN_ADAPTER


def test_missing_or_unreadable_weights(tmp_path, monkeypatch) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(LoRAAdapterError, match="no adapter_model.safetensors"):
        read(str(tmp_path))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoRAAdapterError, match="not a safetensors file this server can read"):
        read(str(tmp_path))
    import safetensors

    def fail(*args, **kwargs):
        raise RuntimeError(f"mmap of {tmp_path}/adapter_model.safetensors failed")

    monkeypatch.setattr(safetensors, "safe_open", fail)  # whatever a library raises is a refusal, no path in it
    with pytest.raises(LoRAAdapterError, match="not a safetensors file") as info:
        read(str(tmp_path))
    assert str(tmp_path) not in str(info.value)


def test_tensors_not_of_the_models_size_are_refused_from_the_header(tmp_path) -> None:
    path = write(tmp_path, {"r": 4}, {f"{PREFIX}.q_proj.lora_A.weight": torch.ones(4, 64),
                                      f"{PREFIX}.q_proj.lora_B.weight": torch.ones(8, 4)})
    with pytest.raises(LoRAAdapterError, match="not that of this model's layer"):
        read(path)
    assert read(path, shapes={"model.layers.0.self_attn.q_proj": (64, 8)}).rank == 4


def test_a_sparse_file_claiming_32_gib_is_refused_before_it_is_read(tmp_path) -> None:
    """lora_B [8, 2^30] float32, r = 8: the rank fits, so a check of the widest dimension
    alone let it through to a 32 GiB read (a RuntimeError, a 500).  The header's claim is
    refused now, the file never mapped."""
    import struct

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    size = 8 * (1 << 30) * 4
    header = json.dumps({f"{PREFIX}.q_proj.lora_B.weight": {"dtype": "F32", "shape": [8, 1 << 30],
                                                             "data_offsets": [0, size]}}).encode()
    with open(tmp_path / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + size)  # sparse: no disk, no memory
    with pytest.raises(LoRAAdapterError, match="not a rank-r LoRA matrix") as info:
        read(str(tmp_path))
    assert "1073741824" not in str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load(tmp_path, bad) -> None:
    tensors = qv()
    tensors[f"{PREFIX}.v_proj.lora_A.weight"][1, 2] = bad
    with pytest.raises(LoRAAdapterError, match="not all finite in float32 once scaled"):
        read(write(tmp_path, {"r": 4, "lora_alpha": 8}, tensors))


def test_weights_that_overflow_the_models_dtype_once_scaled_are_refused(tmp_path) -> None:
    tensors = qv()
    tensors[f"{PREFIX}.q_proj.lora_B.weight"] *= 40_000.0  # finite in float16, but not times scaling 2
    path = write(tmp_path, {"r": 4, "lora_alpha": 8}, tensors)
    assert read(path).scaling == 2.0
    with pytest.raises(LoRAAdapterError, match="not all finite in float16"):
        read(path, dtype=torch.float16)


def test_a_peft_config_as_peft_writes_it_is_served() -> None:
    """Every key PEFT writes at its defaults (training, initialisation and provenance
    settings among them) is accepted: the refusal of unknown options refuses none of them."""
    import peft

    from pagedserve.lora.peft import check_peft_config

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
                             task_type="CAUSAL_LM", layers_to_transform=[0], layers_pattern="layers").to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/adapter_config.json", "w") as f:
            json.dump(config, f, default=str)
        check_peft_config(d, 16)
