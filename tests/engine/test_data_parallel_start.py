"""Starting data-parallel replicas (engine/data_parallel.ReplicaSet) before any replica
runs: what must hold before Ray is imported or reached."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pagedserve.engine.data_parallel import _check_ray_address


def test_ray_is_imported_with_its_fatal_signal_handler_off(tmp_path) -> None:
    """Ray reads RAY_DISABLE_FAILURE_SIGNAL_HANDLER once, when imported; it was set after
    the import, so Ray's handler turned a -dp server's SIGTERM drain into an abort (exit 134,
    requests cut, Ray's agents left running).  A stand-in `ray` records what it saw."""
    fake = tmp_path / "ray"
    fake.mkdir()
    seen = tmp_path / "seen"
    (fake / "__init__.py").write_text(
        f"import os\nopen({str(seen)!r}, 'w').write(os.environ.get('RAY_DISABLE_FAILURE_SIGNAL_HANDLER', 'unset'))\n"
        "raise ImportError('stand-in')\n")
    script = ("import os\nos.environ.pop('RAY_DISABLE_FAILURE_SIGNAL_HANDLER', None)\n"
              "from pagedserve.engine.arg_utils import EngineArgs\n"
              "from pagedserve.engine.data_parallel import ReplicaSet\n"
              "try:\n    ReplicaSet(EngineArgs(data_parallel_size=2))\n"
              "except ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert "Ray, which is not installed" in out.stdout, out
    assert seen.read_text() == "1"


def test_a_ray_address_nothing_answers_at_is_refused_by_name() -> None:
    """ray.init retried such an address without end: the server stayed "loading" for good."""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"ray_address '127.0.0.1:1': nothing answers there"):
        _check_ray_address("127.0.0.1:1")
    with pytest.raises(ValueError, match="ray_address 'ray://127.0.0.1:1'"):
        _check_ray_address("ray://127.0.0.1:1")
    assert time.monotonic() - t0 < 30
    _check_ray_address("auto")  # (Ray's own spellings are Ray's to check)


def test_ray_address_auto_without_a_cluster_is_an_error_naming_the_flag(tmp_path) -> None:
    """ray.init's ConnectionError for "auto" with no cluster reached the CLI as a traceback.
    A stand-in `ray` (a real one may find another test's local cluster) raises Ray's error."""
    fake = tmp_path / "ray"
    (fake / "util").mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "def is_initialized():\n    return False\n"
        "def init(**kwargs):\n    raise ConnectionError('Could not find any running Ray instance.')\n")
    (fake / "util" / "__init__.py").write_text("")
    (fake / "util" / "placement_group.py").write_text("placement_group = None\n")
    (fake / "util" / "scheduling_strategies.py").write_text("PlacementGroupSchedulingStrategy = None\n")
    script = ("from pagedserve.engine.arg_utils import EngineArgs\n"
              "from pagedserve.engine.data_parallel import ReplicaSet\n"
              "try:\n    ReplicaSet(EngineArgs(data_parallel_size=2, ray_address='auto'))\n"
              "except ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert out.stdout.strip() == "ray_address 'auto': Could not find any running Ray instance.", out
