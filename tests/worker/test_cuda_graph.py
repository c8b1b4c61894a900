"""Decode CUDA graphs: sizes, padding, eligibility on CPU; the static padded path
itself through the Triton interpreter (a fresh process); real graphs on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from worker_helpers import Driver, ToyModel, toy_config

from pagedserve.attention.selector import get_attn_backend
from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.cuda_graph import capture_sizes, graphs_unavailable_reason, padded_size
from pagedserve.worker.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_capture_sizes():
    assert capture_sizes(256, 8192) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(20, 8192) == [1, 2, 4, 8, 16, 20]  # every batch up to max_num_seqs has a graph
    assert capture_sizes(3, 8192) == [1, 2, 3]
    assert capture_sizes(64, 6) == [1, 2, 4, 6]  # never more rows than the token budget
    assert capture_sizes(1, 1) == [1]


def test_padded_size():
    sizes = capture_sizes(40, 8192)
    assert [padded_size(sizes, b) for b in (1, 2, 3, 5, 8, 9, 16, 17, 33, 40)] == [1, 2, 4, 8, 8, 16, 16, 32, 40, 40]
    assert padded_size(sizes, 41) is None


def test_graphs_unavailable_reason():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton, torch_paged = get_attn_backend("triton", cpu), get_attn_backend("torch_paged", cpu)
    assert graphs_unavailable_reason(cuda, triton, False) is None
    assert graphs_unavailable_reason(cuda, triton, True) == "enforce_eager=True"
    assert "not CUDA" in graphs_unavailable_reason(cpu, triton, False)
    assert "does not support CUDA graphs" in graphs_unavailable_reason(cuda, torch_paged, False)
    assert "tensor parallelism" in graphs_unavailable_reason(cuda, triton, False, tensor_parallel_size=2)


def _runner_with_fake_graphs(sizes):
    config = toy_config(block_size=4, max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 20, max_num_seqs=8)
    runner = ModelRunner(config, ToyModel().eval())
    runner.initialize_kv_cache()
    runner.graph_runner = SimpleNamespace(sizes=sizes)  # only the sizes matter for planning
    return runner


def _step(runner, reqs, sched):
    """Admit reqs (id -> prompt) as new requests with blocks 1.., then plan `sched`."""
    new, block = [], 1
    for rid, prompt in reqs.items():
        nb = -(-(len(prompt) + 1) // 4)
        new.append(NewRequestData(rid, prompt, [], SamplingParams(temperature=0), list(range(block, block + nb)),
                                  len(prompt) - sched[rid]))
        block += nb
    so = SchedulerOutput(new, CachedRequestData(), sched, sum(sched.values()), set(), set())
    runner.input_batch.update_states(so)
    return runner._prepare_inputs(list(sched), so)


def test_decode_batch_is_padded_to_the_next_graph():
    runner = _runner_with_fake_graphs([1, 2, 4, 8])
    reqs = {f"r{i}": [5 + i] * (3 + 2 * i) for i in range(3)}
    step = _step(runner, reqs, {rid: 1 for rid in reqs})
    assert step.graph_size == 4 and step.common is None
    assert step.sample_rows == [0, 1, 2] and step.logits_idx.tolist() == [0, 1, 2]
    buf = runner.buffers.np
    assert buf["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 4]
    assert buf["seq_lens"][:4].tolist() == [3, 5, 7, 0]  # padding row: seq_len 0 ...
    assert buf["slot_mapping"][0, 3] == -1  # ... and stores nowhere
    assert buf["input_ids"][:4].tolist() == [5, 6, 7, 0] and buf["positions"][:4].tolist() == [2, 4, 6, 0]
    # Slots: request i's last token in its own blocks.
    assert buf["slot_mapping"][0, :3].tolist() == [1 * 4 + 2, 2 * 4 + 4, 4 * 4 + 6]


def test_ineligible_steps_run_eagerly():
    runner = _runner_with_fake_graphs([1, 2, 4])
    mixed = _step(runner, {"a": [5] * 6, "b": [6] * 3}, {"a": 1, "b": 3})  # a prefill in the step
    assert mixed.graph_size is None and mixed.common is not None and mixed.common[0].num_actual_tokens == 4
    runner = _runner_with_fake_graphs([1, 2, 4])
    big = _step(runner, {f"r{i}": [5] * 4 for i in range(5)}, {f"r{i}": 1 for i in range(5)})
    assert big.graph_size is None  # larger than the largest graph
    runner = _runner_with_fake_graphs([1, 2, 4])
    exact = _step(runner, {f"r{i}": [5] * 4 for i in range(4)}, {f"r{i}": 1 for i in range(4)})
    assert exact.graph_size == 4 and np.all(runner.buffers.np["seq_lens"][:4] == 4)


def test_no_graphs_on_cpu_and_only_with_a_graph_safe_backend():
    config = toy_config(kv_cache_memory_bytes=1 << 20)
    runner = ModelRunner(config, ToyModel().eval())
    runner.initialize_kv_cache()
    assert runner.graph_runner is None
    with pytest.raises(ValueError, match="an attention backend that supports CUDA graphs"):
        runner.capture_decode_graphs(use_graphs=False)


def test_static_graph_path_matches_eager_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("graph_static_check.py"))],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_graph_replay_matches_eager(dtype):
    pytest.importorskip("triton", reason="triton is not installed")
    results = {}
    for eager in (True, False):
        config = toy_config(block_size=16, max_num_batched_tokens=512, kv_cache_memory_bytes=8 << 20,
                            max_num_seqs=24, max_model_len=1024)
        config.device_config.enforce_eager = eager
        model = ToyModel().eval().to("cuda", dtype)
        runner = ModelRunner(config, model, device="cuda")
        runner.initialize_kv_cache()
        assert runner.graph_runner.use_graphs is not eager  # eager: the same padded shapes, uncaptured
        drv = Driver(runner, runner.config.cache_config.num_blocks, 512)
        for i in range(21):  # token ids within the toy vocabulary (97)
            drv.add(f"r{i}", [t % 97 for t in range(3 + i, 10 + 13 * i)], SamplingParams(temperature=0),
                    max_tokens=5 + i)
        drv.run()
        results[eager] = {k: v["out"] for k, v in drv.done.items()}
        assert runner.graph_runner.num_replays > 0
        assert bool(runner.graph_runner.graphs) is not eager
    assert results[False] == results[True]
