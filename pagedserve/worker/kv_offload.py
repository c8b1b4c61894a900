"""The KV tier beneath the block pool (core/kv_tier.py): host memory or a directory.

An entry is one block's bytes: every KV tensor's slice for that block id (each
layer's K then V, in the runner's order), flattened to uint8, keyed by the block's
prefix-cache key.  What else makes those bytes valid (model, dtype, block size,
tensor-parallel rank, the cache's tensor shapes) is the tier's *fingerprint*: a host
tier lives and dies with its engine so it needs none, a directory checks it in every
file.

`DiskKVTier` file format (one file per block, `<fingerprint digest>-<key>.kv`):
a 96-byte header -- magic, fingerprint digest (sha256), key, payload length, xxh3-128
of the payload -- then the payload.  Files are written to a temporary name, fsynced
and renamed, so a reader (this server after a restart, or another one sharing the
directory) sees a whole file or none; one that is truncated, corrupted, of another
fingerprint or of the wrong size is a miss and is removed.  Writes run on a
background thread; a step only copies the block's bytes out of the cache.  The
directory is kept under its byte bound by evicting least recently used entries (a
hit refreshes a file's mtime, so the order survives restarts).  An unwritable or
full directory logs one warning and turns the tier off; the engine keeps serving.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import re
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path

import torch
import xxhash

from pagedserve.attention import kv_dtype
from pagedserve.cpu_info import describe_cpu
from pagedserve.platforms import is_cuda

logger = logging.getLogger("pagedserve")

_MAGIC = b"PSKVBLK1"
_HEADER = struct.Struct("<8s32s32sQ16s")  # magic, fingerprint digest, key, payload bytes, checksum
_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_TMP_FILE = re.compile(r"\.tmp-\d+_[^-_/]*-(?:probe|\d+-[0-9a-f]+)")  # (ours: others' .tmp- files are left alone)
_STALE_TMP_SECONDS = 3600.0  # a temporary file older than this is a crashed writer's leftover
# A temporary file whose writer's pid is gone from this host is removed once this old: a
# live write takes milliseconds, and a container sharing the host's name (host networking)
# but not its process ids has writers this host cannot see (removing a live one's file
# failed its rename and turned its tier off).
_DEAD_WRITER_GRACE_SECONDS = 30.0
# Entries read back and verified by a lookup but not yet claimed by an admission: a
# request stuck at the head of the queue is looked up every step, so they are kept,
# within this many bytes (what one lookup stages is always kept until claimed).
_MAX_STAGED_BYTES = 64 * 2**20
# A block file's name under any fingerprint: `<16 hex digits>-<key in hex>.kv`.
_BLOCK_FILE = re.compile(r"[0-9a-f]{16}-[0-9a-fA-F]+\.kv")
# Writing a block onto a name something else holds (a directory made there): that block
# is not kept, the tier goes on (errors of the disk itself turn it off).
_NAME_TAKEN = frozenset({errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST})


def _writer_tag() -> str:
    """Who writes a temporary file: "PID_HOST" (a directory may be shared between hosts,
    or between containers with their own process ids and host names)."""
    return f"{os.getpid()}_{socket.gethostname().replace('-', '').replace('_', '')}"


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that named this temporary file (".tmp-PID_HOST-...") may
    still run: a leftover of a killed writer on this host is removed after
    _DEAD_WRITER_GRACE_SECONDS, not _STALE_TMP_SECONDS; one of another host (or an
    unknown name) is left to the timeout."""
    tag = tmp_name[len(_TMP_PREFIX):].split("-", 1)[0]
    pid, _, host = tag.partition("_")
    if not pid.isdigit() or host != _writer_tag().partition("_")[2]:
        return True
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by someone else
        return True
    return True


def checksum(payload: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def kv_block_tensors(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The distinct cache tensors in the order a payload lays them out (layers sharing
    a tensor pair, in a hybrid layout, count once), as bytes where torch cannot move
    their dtype (float8: kv_dtype.raw)."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for k, v in kv_caches:
        for t in (k, v):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(kv_dtype.raw(t))
    return out


# The files of a model directory whose change changes its KV: the weights and the config
# (a new tokenizer or chat template changes which tokens come, not a token's KV; with
# them in, a touched tokenizer file left a whole bound of another fingerprint behind).
_KV_FILE_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_KV_FILE_NAMES = ("config.json", "model.safetensors.index.json", "preprocessor_config.json", "processor_config.json")


def cpu_identity() -> str:
    """The CPU as its kernels' numerics see it (model, vector ISA, native bf16, torch's
    kernels): KV computed on another kind of CPU is not bit for bit this one's."""
    return describe_cpu()


def _create(path: Path) -> int:
    """A new file of our own at `path`: never one already there, nor a symlink's target (a
    link planted under the start-up probe's predictable name had a file outside the
    directory truncated)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


def files_identity(path: str) -> str:
    """Names, sizes and modification times of the weight and config files at `path` (a
    file, or a directory's top level), hashed: what changes when new weights replace old
    ones at the same path.  Empty for a name that is not a path (a registered model name
    stands for one checksummed file)."""
    try:
        if os.path.isdir(path):
            entries = sorted(os.scandir(path), key=lambda e: e.name)
            stats = [(e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file()
                     and (e.name.endswith(_KV_FILE_SUFFIXES) or e.name in _KV_FILE_NAMES)]
        elif os.path.isfile(path):
            st = os.stat(path)
            stats = [(os.path.basename(path), st.st_size, st.st_mtime_ns)]
        else:
            return ""
    except OSError:
        return ""
    return checksum(repr(stats).encode()).hex()


def block_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors)


def _index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids on the device without making the host wait for the stream (pinned)."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    return idx.pin_memory().to(device, non_blocking=True) if is_cuda(device) else idx


def gather_blocks(tensors: Sequence[torch.Tensor], block_ids: Sequence[int]
                  ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """(one uint8 payload of block_nbytes per block, on the host, each its own
    allocation, so a tier frees them one by one; on CUDA the event after which they
    may be read: they are pinned and filled by copies queued on the current stream, so
    a step does not wait for them)."""
    device = tensors[0].device
    n = len(block_ids)
    rows = torch.cat([t.index_select(0, _index(block_ids, device)).reshape(n, -1).view(torch.uint8)
                      for t in tensors], dim=1)
    if not is_cuda(device):
        return list(rows.unbind(0)) if n == 1 else [row.clone() for row in rows], None
    host = [torch.empty(rows.shape[1], dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    for dst, row in zip(host, rows, strict=True):
        dst.copy_(row, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def scatter_blocks(tensors: Sequence[torch.Tensor], block_ids: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
    """Write payloads (as gather_blocks makes them) into the blocks."""
    device = tensors[0].device
    n = len(block_ids)
    idx = _index(block_ids, device)
    data = torch.stack([row.to(device, non_blocking=True) for row in rows])
    offset = 0
    for t in tensors:
        size = t[0].numel() * t.element_size()
        part = data[:, offset:offset + size].contiguous().view(t.dtype).view(n, *t.shape[1:])
        t.index_copy_(0, idx, part)
        offset += size


# A block's bytes on the host, and the CUDA event after which they may be read (None:
# readable now).
Payload = tuple[torch.Tensor, "torch.cuda.Event | None"]


class _TierBase:
    """Bookkeeping both tiers share: claimed payloads and counters."""

    def __init__(self, capacity_bytes: int, entry_bytes: int, stored_bytes: int | None = None) -> None:
        """`stored_bytes`: what one entry takes where it is kept (a file's header too)."""
        if capacity_bytes < (stored_bytes or entry_bytes):
            raise ValueError(f"the KV tier's size ({capacity_bytes} bytes) holds not even one block "
                             f"({stored_bytes or entry_bytes} bytes as stored)")
        self.capacity_bytes = capacity_bytes
        self.entry_bytes = entry_bytes
        self._lock = threading.Lock()
        # Payloads admissions committed to load this step, until the runner takes them,
        # with how many loads of each are due (two requests may load one prefix).
        self._claimed: dict[int, tuple[Payload, int]] = {}
        self.enabled = True
        self.num_stored = 0  # entries written
        self.num_loaded = 0  # entries loaded into the pool
        self.num_dropped = 0  # saves not kept (writer behind, or tier off)
        self.num_invalid = 0  # entries found damaged, foreign or unreadable (removed)

    def _claim(self, key: int, payload: Payload) -> None:
        held = self._claimed.get(key)
        self._claimed[key] = (payload, 1 if held is None else held[1] + 1)

    def take(self, key: int) -> torch.Tensor:
        """The claimed payload of `key` (the runner loads it into a block); on CUDA,
        once the copy that filled it has landed (a swap-out of an earlier step may
        still be on its way)."""
        payload, count = self._claimed.pop(key)
        if count > 1:
            self._claimed[key] = (payload, count - 1)
        self.num_loaded += 1
        row, ready = payload
        if ready is not None:
            ready.synchronize()
        return row


class HostKVTier(_TierBase):
    """Blocks in host memory (pinned on CUDA), least recently used evicted first."""

    name = "host memory"

    def __init__(self, capacity_bytes: int, entry_bytes: int) -> None:
        super().__init__(capacity_bytes, entry_bytes)
        self._entries: OrderedDict[int, Payload] = OrderedDict()

    def contains(self, key: int) -> bool:
        return key in self._entries

    def lookup(self, keys: Sequence[int]) -> int:
        entries = self._entries
        n = 0
        for key in keys:
            if key not in entries:
                break
            n += 1
        return n

    def claim(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._entries.move_to_end(key)
            self._claim(key, self._entries[key])

    def put(self, keys: Sequence[int], rows: Sequence[torch.Tensor], ready: torch.cuda.Event | None = None) -> None:
        """Keep `rows[i]` under `keys[i]` (payloads from gather_blocks, not copied again)."""
        entries = self._entries
        max_entries = self.capacity_bytes // self.entry_bytes
        for key, row in zip(keys, rows, strict=True):
            if key in entries:
                entries.move_to_end(key)
                continue
            entries[key] = (row, ready)
            self.num_stored += 1
            while len(entries) > max_entries:
                entries.popitem(last=False)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._entries.clear()


class DiskKVTier(_TierBase):
    """Blocks in a directory, bounded in bytes; see the module docstring."""

    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, entry_bytes: int, fingerprint: str) -> None:
        self._file_bytes = _HEADER.size + entry_bytes
        super().__init__(capacity_bytes, entry_bytes, self._file_bytes)
        self.directory = Path(directory)
        self._digest = hashlib.sha256(fingerprint.encode()).digest()
        self._prefix = self._digest.hex()[:16] + "-"
        self._index: OrderedDict[int, None] = OrderedDict()  # entries on disk, least recent first
        # Block files of other fingerprints (another model or setting, or weights since
        # replaced) found at start, oldest first: they count toward the bound and go first.
        self._foreign: deque[str] = deque()
        self._pending: dict[int, Payload] = {}  # saves queued for the writer
        # Read back by lookups; only the engine thread touches it.
        self._staged: OrderedDict[int, Payload] = OrderedDict()
        self._queue: queue.Queue[list[int] | None] = queue.Queue()
        self._max_pending = max(1, min(capacity_bytes, 256 * 2**20) // entry_bytes)
        self._writer: threading.Thread | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f"{_TMP_PREFIX}{_writer_tag()}-probe"
            probe.unlink(missing_ok=True)  # (a link planted under its name goes, its target untouched)
            os.close(_create(probe))
            probe.unlink()
            self._scan()
        except OSError as e:
            self._disable(f"cannot use {self.directory}: {e}")
            return
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload writer", daemon=True)
        self._writer.start()

    # ---------------------------------------------------------------- index
    def _path(self, key: int) -> Path:
        return self.directory / f"{self._prefix}{key:x}{_SUFFIX}"

    def _scan(self) -> None:
        """Index this fingerprint's files, oldest first, and note the block files of the
        others (the bound is the directory's); remove crashed writers' leftovers."""
        found: list[tuple[float, int]] = []
        foreign: list[tuple[float, str]] = []
        now = time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                name = entry.name
                try:
                    if _TMP_FILE.fullmatch(name):
                        age = now - entry.stat().st_mtime
                        if age > _STALE_TMP_SECONDS or (age > _DEAD_WRITER_GRACE_SECONDS and not _writer_alive(name)):
                            os.unlink(entry.path)
                    elif _BLOCK_FILE.fullmatch(name):  # (not a regular file: read as damaged, and removed)
                        key = int(name[17:-len(_SUFFIX)], 16)
                        if self._path(key).name == name:  # (this fingerprint's, by its own spelling)
                            found.append((entry.stat().st_mtime, key))
                        else:
                            foreign.append((entry.stat().st_mtime, name))
                except (OSError, ValueError):
                    continue
        for _, key in sorted(found):
            self._index[key] = None
        self._foreign = deque(name for _, name in sorted(foreign))
        self._evict_to_bound()

    def _evict_to_bound(self, room: int = 0) -> None:
        """Down to the bound (less `room` files for writes to come): other fingerprints'
        files first, then this one's least recently used."""
        max_files = self.capacity_bytes // self._file_bytes - room
        while len(self._index) + len(self._foreign) > max_files:
            if self._foreign:
                try:
                    os.unlink(self.directory / self._foreign.popleft())
                except OSError:
                    pass
                continue
            key, _ = self._index.popitem(last=False)
            self._remove(key)

    def _remove(self, key: int) -> None:
        try:
            os.unlink(self._path(key))
        except OSError:
            pass

    def _disable(self, why: str) -> None:
        if self.enabled:
            logger.warning("KV offload to disk is off: %s; the engine goes on without it", why)
        self.enabled = False
        with self._lock:
            self.num_dropped += len(self._pending)
            self._pending.clear()

    @property
    def num_entries(self) -> int:
        return len(self._index)

    # --------------------------------------------------------------- lookups
    def contains(self, key: int) -> bool:
        return self.enabled and (key in self._index or key in self._pending)

    def lookup(self, keys: Sequence[int]) -> int:
        if not self.enabled:
            return 0
        staged = self._staged
        # Drop what earlier lookups staged and no admission claimed, oldest first; never
        # what this one stages (every hit of a lookup is claimed right after it).
        while len(staged) * self.entry_bytes > _MAX_STAGED_BYTES:
            staged.popitem(last=False)
        n = 0
        for key in keys:
            if key in staged or key in self._claimed:
                n += 1
                continue
            with self._lock:
                payload = self._pending.get(key)  # (the writer may finish it any moment)
            if payload is None:
                if key not in self._index:
                    break
                payload = self._read(key)
                if payload is None:
                    # The blocks behind a bad one hang off its hash chain: unreachable until it is saved
                    # again, and while indexed, never saved again once recomputed (a damaged directory
                    # healed one block per prefix per restart).  Their files go with it.
                    for later in keys[n + 1:]:
                        if later in self._index:
                            self._forget(later, remove=True)
                    break
            staged[key] = payload
            n += 1
        return n

    def _read(self, key: int) -> Payload | None:
        """The verified payload of `key`, or None (a bad file is removed)."""
        path = self._path(key)
        try:
            data = self._read_file(path)
        except OSError:
            self._forget(key, remove=False)
            return None
        why = self._check(data, key) if isinstance(data, bytes) else data
        if why is not None:
            self.num_invalid += 1
            logger.warning("KV offload: %s %s; recomputing instead and removing it", path.name, why)
            self._forget(key, remove=True)
            return None
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return torch.frombuffer(bytearray(data[_HEADER.size:]), dtype=torch.uint8), None

    def _read_file(self, path: Path) -> bytes | str:
        """The file's bytes, or why it is not a block file, read without blocking and
        within one file's size: the engine thread reads here, and another writer of the
        directory may have left a FIFO (a read that never returns) or a file of gigabytes
        (read whole before its size was checked) under a block's name."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "is a symbolic link"
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return "is not a regular file"
            if info.st_size != self._file_bytes:
                return f"holds {info.st_size} bytes, not {self._file_bytes}"
            data = bytearray()
            while len(data) < self._file_bytes:
                chunk = os.read(fd, self._file_bytes - len(data))
                if not chunk:
                    break
                data += chunk
            return bytes(data)
        finally:
            os.close(fd)

    def _check(self, data: bytes, key: int) -> str | None:
        if len(data) < _HEADER.size:
            return "is truncated"
        magic, digest, stored_key, size, crc = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            return "is not a KV block file"
        if digest != self._digest:
            return "was written for another model, dtype, block size or layout"
        if int.from_bytes(stored_key, "little") != key:
            return "holds another block"
        if size != self.entry_bytes:
            return f"holds {size} bytes, not {self.entry_bytes}"
        if len(data) != _HEADER.size + size:
            return "is truncated"
        if checksum(memoryview(data)[_HEADER.size:]) != crc:
            return "fails its checksum"
        return None

    def _forget(self, key: int, remove: bool) -> None:
        with self._lock:
            self._index.pop(key, None)
        if remove:
            self._remove(key)

    def claim(self, keys: Sequence[int]) -> None:
        for key in keys:
            held = self._claimed.get(key)
            self._claim(key, held[0] if held is not None else self._staged.pop(key))

    # ---------------------------------------------------------------- writes
    def put(self, keys: Sequence[int], rows: Sequence[torch.Tensor], ready: torch.cuda.Event | None = None) -> None:
        """Queue `rows[i]` to be written under `keys[i]` (after `ready`, on CUDA); never
        waits for the disk."""
        if not self.enabled:
            self.num_dropped += len(keys)
            return
        queued = []
        with self._lock:
            for key, row in zip(keys, rows, strict=True):
                if key in self._index or key in self._pending:
                    continue
                if len(self._pending) >= self._max_pending:
                    self.num_dropped += 1  # the writer is behind: this block is recomputed if needed
                    continue
                self._pending[key] = (row, ready)
                queued.append(key)
        if queued:
            self._queue.put(queued)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            for key in item:
                with self._lock:
                    payload = self._pending.get(key)
                if payload is None or not self.enabled:
                    continue
                row, ready = payload
                if ready is not None:
                    ready.synchronize()  # gather_blocks' copy to the host has landed
                with self._lock:
                    self._index.pop(key, None)  # (rewritten: it counts once)
                    self._evict_to_bound(room=1)  # room first: the directory never holds more
                try:
                    self._write(key, row)
                except OSError as e:
                    if e.errno in _NAME_TAKEN:
                        with self._lock:
                            self._pending.pop(key, None)
                            self.num_dropped += 1
                        continue
                    self._disable(f"writing {self._path(key)} failed: {e}")
                    continue
                with self._lock:
                    self._pending.pop(key, None)
                    self._index[key] = None
                    self.num_stored += 1

    def _write(self, key: int, payload: torch.Tensor) -> None:
        body = payload.numpy().tobytes()
        header = _HEADER.pack(_MAGIC, self._digest, key.to_bytes(32, "little"), len(body), checksum(body))
        tmp = self.directory / f"{_TMP_PREFIX}{_writer_tag()}-{threading.get_ident()}-{key:x}"
        try:
            with os.fdopen(_create(tmp), "wb") as f:
                f.write(header)
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def flush(self, timeout: float = 30.0) -> None:
        """Wait (at most `timeout` s) until every queued write is on disk."""
        deadline = time.monotonic() + timeout
        while self._pending and self.enabled and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        if self._writer is not None:
            self.flush()
            self._queue.put(None)
            self._writer.join(timeout=5)
            self._writer = None


# Sizes when only part of the tier is configured: a directory without a bound, and
# swap preemption without a tier (vLLM's default swap space).
DEFAULT_DISK_TIER_BYTES = 8 * 2**30
DEFAULT_SWAP_SPACE_BYTES = 4 * 2**30


def make_kv_tier(directory: str | None, capacity_bytes: int | None, swap: bool, entry_bytes: int,
                 fingerprint: str) -> HostKVTier | DiskKVTier | None:
    """The configured tier, logged: a directory when one is given (bounded by capacity_bytes,
    default 8 GiB), else host memory of capacity_bytes (or 4 GiB for swap alone)."""
    tier: HostKVTier | DiskKVTier | None = None
    if directory is not None:
        tier = DiskKVTier(directory, capacity_bytes or DEFAULT_DISK_TIER_BYTES, entry_bytes, fingerprint)
    elif capacity_bytes is not None or swap:
        tier = HostKVTier(capacity_bytes or DEFAULT_SWAP_SPACE_BYTES, entry_bytes)
    if tier is not None:
        logger.info("KV tier: %s (%s)%s", tier.name, directory or "no directory", "" if tier.enabled else ", off")
    return tier
