"""Ctrl-C and interpreter exit, in a child interpreter (signals reach its whole process group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.distributed.conftest import process_alive

CHILD = os.path.join(os.path.dirname(__file__), "lifecycle_child.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ctrl_c_then_exit_leave_no_process(tp_checkpoint) -> None:
    path = tp_checkpoint("llama", 1)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, CHILD, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("STEPPING 2"):  # printed from inside the second generate()
                break
        if not lines or not lines[0].startswith("PIDS"):  # the child died before its engine was up
            proc.kill()
            out, err = proc.communicate(timeout=60)
            raise AssertionError(f"child exited {proc.returncode}; stdout {lines + out.splitlines()}; "
                                 f"stderr: {err[-4000:]}")
        pids = [int(x) for x in lines[0].split()[1:]]
        assert pids, lines
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        t0 = time.monotonic()
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("INTERRUPTED"):
                break
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 5
        while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(process_alive(p) for p in pids), "a worker outlived Ctrl-C"
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines += out.splitlines()
    assert proc.returncode == 0, err[-2000:]
    pids2 = [int(x) for x in next(line for line in lines if line.startswith("PIDS2")).split()[1:]]
    assert any(line.startswith("DONE 4") for line in lines)
    assert not any(process_alive(p) for p in pids2), "a worker outlived interpreter exit"
    assert "leaked" not in err and "Traceback" not in err, err[-2000:]
