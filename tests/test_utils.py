"""pagedserve/utils.py helpers that touch processes and the garbage collector."""

from __future__ import annotations

import subprocess
import sys
import time
import weakref


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


def test_kill_descendants_spares_the_resource_tracker_which_unlinks_shared_memory_after_exit() -> None:
    """A tensor-parallel server's second signal (kill_descendants, then os._exit) left its
    step channel and the workers' semaphores in /dev/shm: the resource tracker that would
    unlink them after the exit had been killed with the rest."""
    import os

    script = ("import os\nfrom multiprocessing import shared_memory\n"
              "from pagedserve.utils import kill_descendants\n"
              "shm = shared_memory.SharedMemory(create=True, size=4096)\n"
              "print(shm.name, flush=True)\n"
              "kill_descendants()\n"
              "os._exit(3)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out
    path = os.path.join("/dev/shm", out.stdout.strip().lstrip("/"))
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = os.path.exists(path)
    if left:
        os.unlink(path)
    assert not left, f"{path} was left behind"


def test_the_start_up_collector_pause_ends_at_the_settle_and_only_resumes_what_it_paused() -> None:
    import gc

    from pagedserve.utils import pause_collector, settle_start_up_heap

    assert gc.isenabled()
    try:
        pause_collector()
        assert not gc.isenabled()
        garbage = []
        garbage.append(garbage)  # a cycle: the settle's collection frees it rather than freezing it
        ref = weakref.ref(_Cycle(garbage))
        del garbage
        settle_start_up_heap()
        assert gc.isenabled() and gc.get_freeze_count() > 0 and ref() is None
        gc.disable()  # collections off by the caller's choice: a settle leaves them off
        settle_start_up_heap()
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Cycle:
    def __init__(self, other: object) -> None:
        self.me, self.other = self, other
