"""Small pure-Python helpers used across the package (no torch: `core/` imports this)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` hold `a` items."""
    return -(-a // b)


def is_int(x: object) -> bool:
    """An integer that is not a bool (True is an int to Python, never a count to us)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """An int or a float that is not a bool (True is not 1 ms, nor a threshold of 1)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
