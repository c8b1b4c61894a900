"""pagedserve/utils.py helpers that touch processes."""

from __future__ import annotations

import subprocess
import sys
import time


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # (a zombie is dead, awaiting its parent)
    except OSError:
        return False


def test_kill_descendants_takes_children_and_grandchildren_not_the_caller() -> None:
    """A second signal's immediate exit left a local Ray's agents (the raylet's children)
    running; now every descendant is killed first.  Run in a child: in this process it
    would kill the suite's servers."""
    script = ("import subprocess, sys, time\n"
              "from pagedserve.utils import kill_descendants\n"
              "child = subprocess.Popen(['bash', '-c', 'sleep 60 & echo $!; wait'], stdout=subprocess.PIPE, text=True)\n"
              "grandchild = int(child.stdout.readline())\n"
              "print(child.pid, grandchild, flush=True)\n"
              "kill_descendants()\n"
              "child.wait()\n"
              "print('caller alive', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    lines = out.stdout.split("\n")
    child, grandchild = map(int, lines[0].split())
    assert lines[1] == "caller alive", out
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child) and not _alive(grandchild)
