"""What the benchmarks share: a server subprocess on a loopback port, ready once /health
answers (`pagedserve serve` itself, or any other server such as llama.cpp's), the
resident memory of a server's process tree, and Prometheus text parsed into samples."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from pagedserve.utils import rss_bytes

PORT_ATTEMPTS = 3  # servers started on a port another process took first, before giving up


def check_output_file(path: str | None, flag: str) -> None:
    """A results file the run will write at its end, checked before it starts (a directory
    was a traceback, and a missing folder lost the figures, after the whole run)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path!r}: not a file that can be written (is its folder there and writable?)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens_on(pid: int | None, port: int) -> bool | None:
    """Whether process `pid` (None: any process) holds a TCP socket listening on `port`,
    from Linux's /proc; None where that cannot be read (another OS, the process gone)."""
    try:
        inodes = None if pid is None else _socket_inodes(pid)
        found = False
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):  # (a kernel without IPv6 has no tcp6)
                continue
            found = True
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()  # sl, local address:port (hex), remote, state, ..., inode
                    if (fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port
                            and (inodes is None or fields[9] in inodes)):
                        return True
        return False if found else None
    except OSError:
        return None


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


class LocalServer:
    """An HTTP server subprocess on a loopback port, ready once /health answers 200;
    subclasses give `command(port)`, its command line.  Its output goes to `log_path`."""

    what = "server"
    ready_timeout = 300.0

    def __init__(self, log_path: str | None = None, env: dict[str, str] | None = None,
                 ready_timeout: float | None = None) -> None:
        self.log_path = log_path
        timeout = ready_timeout or self.ready_timeout
        # A free port can be taken by another process before the server binds it (two
        # servers started at once, by two test workers say): then /health answered from
        # the other server, and requests went there.  Ready means this process listens;
        # if it exits while another process listens on its port, it starts on another.
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._log = open(log_path or os.devnull, "w")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen(self.command(self.port), stdout=self._log, stderr=subprocess.STDOUT, env=env)
            if self._wait_ready(timeout, last=attempt == PORT_ATTEMPTS - 1):
                return
            self._log.close()

    def _wait_ready(self, timeout: float, last: bool) -> bool:
        """True once /health answers 200 from this process; False when it exited while
        another process listened on its port (taken: try another, unless `last`); raises
        otherwise."""
        # One client for the polls: each new one loads the CA bundle (20-40 ms of CPU), and
        # at five polls a second that was a tenth of a core taken from the starting server.
        with httpx.Client(timeout=2) as client:
            ready = self._poll_until_ready(client, time.monotonic() + timeout, last)
        if ready is not None:
            return ready
        self.stop()
        raise RuntimeError(f"{self.what} did not become ready in {timeout:.0f} s ({self.log_path}):\n"
                           f"{self.log_tail()}")

    def _poll_until_ready(self, client: httpx.Client, deadline: float, last: bool) -> bool | None:
        """_wait_ready's polls: True once healthy, False for a taken port, None at the
        deadline; raises when the process exited otherwise."""
        foreign = False
        while time.monotonic() < deadline:
            mine = listens_on(self.proc.pid, self.port)
            foreign = foreign or (mine is False and listens_on(None, self.port) is True)
            if self.proc.poll() is not None:
                if foreign and not last:
                    return False
                taken = " (another process held its port)" if foreign else ""
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}{taken} ({self.log_path}):\n"
                                   f"{self.log_tail()}")
            try:
                if mine is not False and client.get(self.url + "/health").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return None

    def log_tail(self, chars: int = 5000) -> str:
        """The end of the server's output so far ('' without a log file)."""
        if not self.log_path:
            return ""
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class PagedServe(LocalServer):
    """`pagedserve serve ARGS` (ARGS: the model, then any flags).  Its output goes to
    `log_path`, else to a temporary file that is kept (and named on failure).  `module`:
    what `python -m` runs (tests start a launcher that injects a fault)."""

    what = "pagedserve serve"
    ready_timeout = 900.0  # a first start on a clean machine builds kernels and compiles

    def __init__(self, args: list[str], log_path: str | None = None, *, env: dict[str, str] | None = None,
                 ready_timeout: float | None = None, module: str = "pagedserve.entrypoints.cli") -> None:
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="pagedserve-serve-", suffix=".log")
            os.close(fd)
        self.args, self.module = args, module
        super().__init__(log_path=log_path, env=env, ready_timeout=ready_timeout)

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", self.module, "serve", *self.args, "--host", "127.0.0.1", "--port", str(port)]


# --------------------------------------------------------------------------- memory
@dataclass
class RssSample:
    """Resident bytes of a server: its own process, its children that run the same
    executable (tensor-parallel workers: part of the server), and apart from those any other
    descendant (a compiler a kernel build started, or a fork not yet running its program,
    which come and go and are not the server's memory; a compiler can hold a gigabyte)."""

    main: int
    workers: int = 0
    num_workers: int = 0
    transient: int = 0
    num_transient: int = 0

    @property
    def total(self) -> int:
        """The server's own processes."""
        return self.main + self.workers


def process_rss(pid: int) -> RssSample | None:
    """RSS of a process and all its descendants (from /proc); None if it is gone."""

    def children(p: int) -> list[int]:
        out: list[int] = []
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    out += [int(c) for c in f.read().split()]
        except OSError:
            pass
        return out

    def program(p: int) -> tuple[str, bytes] | None:
        """(executable, command line): a worker runs the server's executable with its own
        command line; a child with both the server's is a fork on its way to run something
        else (a subprocess starting), sharing the server's pages, not a second copy."""
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return os.readlink(f"/proc/{p}/exe"), f.read()
        except OSError:
            return None

    main = rss_bytes(pid)
    if not main:
        return None
    sample = RssSample(main)
    server = program(pid)
    todo = children(pid)
    while todo:
        c = todo.pop()
        rss = rss_bytes(c)
        if rss:
            child = program(c)
            if server is not None and child is not None and child[0] == server[0] and child[1] != server[1]:
                sample.workers += rss
                sample.num_workers += 1
            else:
                sample.transient += rss
                sample.num_transient += 1
            todo += children(c)
    return sample


# --------------------------------------------------------------------------- metrics
def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text (a /metrics page) as {sample name: [(labels, value), ...]}."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples
