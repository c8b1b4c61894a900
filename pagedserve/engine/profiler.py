"""torch.profiler traces of the engine on demand: vLLM's `LLM.start_profile()` /
`stop_profile()` and the server's `POST /start_profile` / `POST /stop_profile`.

Off unless a directory is named: `LLM(..., profiler_config={"profiler": "torch",
"torch_profiler_dir": DIR})` (vLLM's argument), or `$PAGEDSERVE_TORCH_PROFILER_DIR` /
`$VLLM_TORCH_PROFILER_DIR` (the server's way, as vLLM's was).  Each stop writes one Chrome
trace (`<prefix>-<milliseconds>.pt.trace.json`, open it in Perfetto or chrome://tracing)
and returns its path.  Every thread's operators are recorded: a server's engine steps on
its own thread, not the one that asked.  Tensor-parallel worker processes are not (their
operators run in other processes).  A profile holds its events in memory until it stops,
so one runs at a time and a server's stops itself after `max_seconds`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any

logger = logging.getLogger("pagedserve")

ENV_DIRS = ("PAGEDSERVE_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


def profiler_dir(config: dict[str, Any] | None = None) -> str | None:
    """The trace directory: vLLM's profiler_config (its "torch" profiler, a directory), else
    the environment's; None: profiling off."""
    if config:
        if not isinstance(config, dict) or config.get("profiler", "torch") != "torch" or \
                set(config) - {"profiler", "torch_profiler_dir"} or not config.get("torch_profiler_dir"):
            raise ValueError(f'profiler_config takes {{"profiler": "torch", "torch_profiler_dir": DIR}} here, '
                             f"got {config!r:.120}")
        return _trace_dir(str(config["torch_profiler_dir"]), "profiler_config's torch_profiler_dir")
    name = next((name for name in ENV_DIRS if os.environ.get(name)), None)
    return None if name is None else _trace_dir(os.environ[name], f"${name}")


def _trace_dir(path: str, source: str) -> str:
    """Refused at start where it cannot be a directory (a file: /start_profile was a 500)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{source} {path!r} is a file; profiles are written to a directory")
    return path


class Profiler:
    """One torch profile at a time into `directory` (None: off, and asking says how to turn it on)."""

    def __init__(self, directory: str | None, max_seconds: float | None = None) -> None:
        self.directory, self.max_seconds = directory, max_seconds
        self._lock = threading.Lock()
        self._profile: Any = None
        self._prefix = ""
        self._timer: threading.Timer | None = None
        self._started = 0  # profiles started: a timer stops only its own

    def start(self, prefix: str | None = None) -> None:
        if self.directory is None:
            raise RuntimeError("profiling is off: name a trace directory with LLM(profiler_config={'profiler': "
                               "'torch', 'torch_profiler_dir': DIR}) or $VLLM_TORCH_PROFILER_DIR")
        import torch
        from torch.profiler import ProfilerActivity, profile

        with self._lock:
            if self._profile is not None:
                raise RuntimeError("a profile is already running (stop_profile ends it)")
            try:
                os.makedirs(self.directory, exist_ok=True)
            except OSError as e:
                raise RuntimeError(f"cannot make the trace directory {self.directory!r} ({e.strerror})") from None
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profile = profile(activities=activities, record_shapes=True,
                                    experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True))
            self._prefix = re.sub(r"[^A-Za-z0-9_.-]", "_", prefix or "pagedserve")[:100]  # (a file name)
            self._profile.start()
            self._started += 1
            if self.max_seconds is not None:
                self._timer = threading.Timer(self.max_seconds, self._stop_if_running, (self._started,))
                self._timer.daemon = True
                self._timer.start()
        logger.info("profiling started (traces to %s)", self.directory)

    def stop(self, which: int | None = None) -> str:
        """End the profile (`which`: only if it is the one started that many-th) and write
        its trace; its path."""
        with self._lock:
            if self._profile is None or which not in (None, self._started):
                raise RuntimeError("no profile is running (start_profile starts one)")
            running, self._profile = self._profile, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            running.stop()
            path = os.path.join(self.directory or ".", f"{self._prefix}-{int(time.time() * 1000)}.pt.trace.json")
            running.export_chrome_trace(path)
        logger.info("profile written to %s", path)
        return path

    def _stop_if_running(self, which: int) -> None:
        try:
            path = self.stop(which)  # (a timer that fired as its profile stopped leaves the next one be)
        except RuntimeError:
            return  # (stopped meanwhile)
        logger.warning("profile stopped after %.0f s (its most), written to %s", self.max_seconds, path)
