"""Small pure-Python helpers used across the package (no torch: `core/` imports this)."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` hold `a` items."""
    return -(-a // b)


def is_int(x: object) -> bool:
    """An integer that is not a bool (True is an int to Python, never a count to us)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """An int or a float that is not a bool (True is not 1 ms, nor a threshold of 1)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def same_value(value: object, allowed: tuple[object, ...]) -> bool:
    """`value` is one of `allowed`: equal and of its type, or an equal number (JSON's true
    is not 1 nor 0 false; 1 is 1.0).  The one rule for "a value that asks for nothing"."""
    return any(type(value) is type(a) and value == a or is_number(value) and is_number(a) and value == a
               for a in allowed)


# Seconds spent in each start-up phase of this process, in the order they ran: each phase
# records itself where it happens (weights, kernel builds, KV allocation, compile), and
# the engine logs the breakdown once it is ready.
_STARTUP: dict[str, float] = {}


def record_startup(phase: str, seconds: float) -> None:
    _STARTUP[phase] = _STARTUP.get(phase, 0.0) + seconds


def startup_breakdown() -> str:
    """'weights 1.2 s, compile 3.0 s, ...' for the phases recorded so far (then forgotten)."""
    text = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in _STARTUP.items())
    _STARTUP.clear()
    return text


class _StartUpCollector:
    """The garbage collector paused while a command starts (pause_collector), then
    settled once (settle_start_up_heap).  Starting imports torch and the serving stack
    and builds the model: ~300k objects that live until the process exits, and each full
    collection on the way walked all of them again (three of them ~0.3 s of a `generate`
    on Zen 4, one 136 ms).  Settled, one collection frees what start-up threw away and
    `gc.freeze` takes the rest out of the collector's sight: a full collection while
    serving walked them too, ~0.15 s of whichever thread set it off (an engine step, the
    event loop)."""

    paused = False


def pause_collector() -> None:
    """Pause collections until settle_start_up_heap (the `pagedserve` command, at start)."""
    _StartUpCollector.paused = gc.isenabled()
    gc.disable()


def settle_start_up_heap() -> None:
    """Start-up is over (an engine built, a server ready): collect once, freeze what
    survives, and resume collections where pause_collector paused them.  Also where
    nothing paused them (a server started from Python): freezing is as right there."""
    gc.collect()
    gc.freeze()
    if _StartUpCollector.paused:
        _StartUpCollector.paused = False
        gc.enable()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS), in bytes; 0 where /proc is not there."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# Byte units spelled out (any case): decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB.
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_READABLE = re.compile(r"\s*(-?\d+(?:\.\d+)?)([kmgtKMGT]?)\s*")


def readable_number(text: str) -> int | None:
    """vLLM's human-readable integers (its human_readable_int): a suffix k, m, g, t is a
    power of 1000 (a fraction allowed: "25.6k"), K, M, G, T a power of 1024 (whole numbers
    only: "32K"); None where `text` is not one.  Token counts and byte sizes alike."""
    m = _READABLE.fullmatch(text)
    if not m or "." in m.group(1) and not m.group(2).islower():
        return None
    number, suffix = m.groups()
    if suffix.islower():  # (in decimal: float's 1.005 x 1000 is 1004.99...)
        from decimal import Decimal

        return int(Decimal(number) * 1000 ** ("kmgt".index(suffix) + 1))
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1 if suffix else 0)


def parse_bytes(value: int | str, name: str = "size") -> int:
    """1073741824, "1GiB", "1G" (vLLM's: 2^30), "1g" or "1GB" (10^9), "1.5g" -> bytes."""
    if is_int(value):
        n = value
    elif isinstance(value, str):
        n = readable_number(value)
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", value)
        if n is None and m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if n is None:
            raise ValueError(f"{name} must be a byte count such as 2147483648, '2GiB' or '512M' (k, m, g: powers "
                             f"of 1000; K, M, G: of 1024, whole numbers; spelled out, kB, MB, GB or KiB, MiB, "
                             f"GiB, fractions too), got {value!r}")
    else:
        raise ValueError(f"{name} must be an integer number of bytes or a string like '2GiB', got {value!r}")
    if n < 1:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return n


def kill_descendants() -> None:
    """SIGKILL every process descended from this one (read from /proc; nothing elsewhere):
    what an immediate exit must not leave behind.  A second Ctrl-C's exit left Ray's
    agents running, children of the raylet that died with this process.

    Except multiprocessing's resource tracker: it ignores signals and, once this process
    is gone, unlinks the shared memory and semaphores still registered (the tensor-parallel
    step channel, the workers' wake-ups).  Killed, it left them in /dev/shm for good."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            children.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):  # (not a process, or gone meanwhile)
            continue
    todo, found = [os.getpid()], []
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    for pid in found:
        if not _is_resource_tracker(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False
