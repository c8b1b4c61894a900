"""Fixtures of the models area."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.models.models_helpers import make_hf_model


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """tiny_checkpoint(case) -> (directory with config.json + model.safetensors, the HF model)."""

    def make(case: str, **overrides: Any) -> tuple[str, torch.nn.Module]:
        model = make_hf_model(case, **overrides)
        path = tmp_path / case
        model.save_pretrained(path)
        return str(path), model

    return make
