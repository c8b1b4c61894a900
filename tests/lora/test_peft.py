"""Reading PEFT adapters: what is served, and every option that changes the math refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.lora.peft import LoRAAdapterError, read_peft_adapter

PREFIX = "base_model.model.model.layers.0.self_attn"


def write(path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def qv(r: int = 4) -> dict[str, torch.Tensor]:
    return {f"{PREFIX}.{m}.lora_{h}.weight": torch.ones(*((r, 8) if h == "A" else (8, r)))
            for m in ("q_proj", "v_proj") for h in ("A", "B")}


def test_rank_alpha_and_rslora_scaling(tmp_path) -> None:
    adapter = read_peft_adapter(write(tmp_path, {"peft_type": "LORA", "r": 4, "lora_alpha": 8}, qv()), 16)
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert set(adapter.weights) == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"}
    rs = read_peft_adapter(write(tmp_path, {"r": 4, "lora_alpha": 8, "use_rslora": True}, qv()), 16)
    assert math.isclose(rs.scaling, 4.0)


@pytest.mark.parametrize("option, value", [("use_dora", True), ("bias", "all"), ("fan_in_fan_out", True),
                                           ("modules_to_save", ["lm_head"]), ("rank_pattern", {"q_proj": 8})])
def test_options_that_change_the_math_are_refused_by_name(tmp_path, option, value) -> None:
    path = write(tmp_path, {"r": 4, "lora_alpha": 8, option: value}, qv())
    with pytest.raises(LoRAAdapterError, match=f"adapter option {option}="):
        read_peft_adapter(path, 16)


@pytest.mark.parametrize("config, tensors, message", [
    ({"peft_type": "IA3", "r": 4}, qv(), "peft_type 'IA3' is not a LoRA adapter"),
    ({"r": 0}, qv(), "rank r must be a positive integer"),
    ({"r": 4, "lora_alpha": "big"}, qv(), "lora_alpha must be a number"),
    ({"r": 2}, qv(4), "not a rank-2 LoRA matrix"),
    ({"r": 4}, {f"{PREFIX}.q_proj.lora_A.weight": torch.ones(8, 4), f"{PREFIX}.q_proj.lora_B.weight": torch.ones(8, 4)},
     "do not have rank r=4"),
    ({"r": 4}, {"base_model.model.lm_head.lora_A.weight": torch.ones(4, 8),
                "base_model.model.lm_head.lora_B.weight": torch.ones(8, 4)}, "embedding or LM head"),
    ({"r": 4}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 8)}, "embedding or LM head"),
    ({"r": 4}, {f"{PREFIX}.q_proj.lora_A.weight": torch.ones(4, 8)}, "not both lora_A and lora_B"),
    ({"r": 4}, {f"{PREFIX}.q_proj.weight": torch.ones(8, 8)}, "is not a LoRA weight"),
])
def test_malformed_adapters_are_refused_by_name(tmp_path, config, tensors, message) -> None:
    with pytest.raises(LoRAAdapterError, match=message):
        read_peft_adapter(write(tmp_path, config, tensors), 16)


def test_missing_or_oversized_files(tmp_path) -> None:
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        read_peft_adapter(str(tmp_path), 16)
    (tmp_path / "adapter_config.json").write_text(" " * (1 << 20) + "{}")
    with pytest.raises(LoRAAdapterError, match="over 1048576 bytes"):
        read_peft_adapter(str(tmp_path), 16)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(LoRAAdapterError, match="no adapter_model.safetensors"):
        read_peft_adapter(str(tmp_path), 16)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoRAAdapterError, match="cannot read"):
        read_peft_adapter(str(tmp_path), 16)


def test_tensors_wider_than_the_model_are_refused_from_the_header(tmp_path) -> None:
    path = write(tmp_path, {"r": 4}, {f"{PREFIX}.q_proj.lora_A.weight": torch.ones(4, 64),
                                      f"{PREFIX}.q_proj.lora_B.weight": torch.ones(8, 4)})
    with pytest.raises(LoRAAdapterError, match=r"shape \(4, 64\), not a rank-4 LoRA matrix of this model's size"):
        read_peft_adapter(path, 16, max_features=32)
    assert read_peft_adapter(path, 16, max_features=64).rank == 4
