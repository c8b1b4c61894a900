"""The engine's async_scheduling option: resolution, validation and the CLI flag.
(Generation with overlap scheduling is compared with the synchronous engine in
tests/e2e/test_overlap_parity.py, on a real model runner.)"""

from __future__ import annotations

import argparse

import pytest
import torch
from fake_runner import make_engine

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core import resolve_async_scheduling


class _Executor:
    def __init__(self, device_type: str, supports_async: bool = True) -> None:
        self.device = torch.device(device_type)
        self.supports_async_scheduling = supports_async


def test_default_is_on_for_cuda_only():
    assert resolve_async_scheduling(None, _Executor("cuda")) is True
    assert resolve_async_scheduling(None, _Executor("cpu")) is False
    assert resolve_async_scheduling(False, _Executor("cuda")) is False
    assert resolve_async_scheduling(True, _Executor("cpu")) is True
    # e.g. the tensor-parallel executor
    assert resolve_async_scheduling(None, _Executor("cuda", supports_async=False)) is False


def test_runner_without_async_launch_is_refused():
    with pytest.raises(ValueError, match="async_scheduling=True needs a model executor"):
        make_engine(async_scheduling=True)
    engine = make_engine()  # the fake runner: default resolves to off
    assert engine.async_scheduling is False and engine.config.scheduler_config.async_scheduling is False


def test_engine_args_validation_and_flag():
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        EngineArgs(async_scheduling="yes")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).async_scheduling is None
    assert EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    cfg = EngineArgs(async_scheduling=False).create_engine_config(load_hf_config=False)
    assert cfg.scheduler_config.async_scheduling is False
