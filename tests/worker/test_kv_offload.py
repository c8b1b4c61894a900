"""The KV tier's stores: bytes round-trip exactly, a damaged or foreign file is a miss
(and is removed), the directory stays under its bound, and a bad directory turns the
tier off instead of failing the engine."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from pagedserve.worker.kv_offload import (
    DiskKVTier,
    HostKVTier,
    block_nbytes,
    gather_blocks,
    kv_block_tensors,
    make_kv_tier,
    scatter_blocks,
)

FP = "model=test|dtype=bf16|block_size=4"


def caches(num_blocks: int = 8, dtype=torch.bfloat16, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of different shapes (a payload must lay out any mix)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(num_blocks, 4, 2, 8, generator=g).to(dtype), torch.randn(num_blocks, 4, 2, 8, generator=g).to(dtype)),
            (torch.randn(num_blocks, 4, 1, 16, generator=g).to(dtype), torch.randn(num_blocks, 4, 1, 16, generator=g).to(dtype))]


def disk_tier(path, capacity: int | None = None, fingerprint: str = FP, entry_bytes: int | None = None) -> DiskKVTier:
    entry = entry_bytes or block_nbytes(kv_block_tensors(caches()))
    return DiskKVTier(str(path), capacity or 1000 * entry, entry, fingerprint)


def save(tier, kv, block_ids: list[int], keys: list[int]) -> None:
    rows, ready = gather_blocks(kv_block_tensors(kv), block_ids)
    tier.put(keys, rows, ready)
    if isinstance(tier, DiskKVTier):
        tier.flush()


def load(tier, kv, block_ids: list[int], keys: list[int]) -> None:
    assert tier.lookup(keys) == len(keys)
    tier.claim(keys)
    scatter_blocks(kv_block_tensors(kv), block_ids, [tier.take(k) for k in keys])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_payload_round_trip_is_bit_identical(dtype) -> None:
    src, dst = caches(dtype=dtype), caches(dtype=dtype, seed=1)
    tensors = kv_block_tensors(src)
    assert block_nbytes(tensors) == 4 * (2 * 8 * 2 + 16 * 2) * torch.empty((), dtype=dtype).element_size()
    rows, _ = gather_blocks(tensors, [3, 5])
    scatter_blocks(kv_block_tensors(dst), [6, 1], rows)
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(dk[6].view(torch.uint8), sk[3].view(torch.uint8))
        assert torch.equal(dv[1].view(torch.uint8), sv[5].view(torch.uint8))
    assert not torch.equal(dst[0][0][0], src[0][0][0])  # untouched blocks stay


def test_shared_tensor_pairs_count_once() -> None:
    k, v = torch.zeros(4, 2, 1, 4), torch.zeros(4, 2, 1, 4)
    assert kv_block_tensors([(k, v), (k, v)]) == [k, v]


def test_disk_round_trip_survives_a_restart(tmp_path) -> None:
    src = caches()
    tier = disk_tier(tmp_path)
    save(tier, src, [1, 2, 3], [11, 12, 13])
    assert tier.num_stored == 3 and all(tier.contains(k) for k in (11, 12, 13))
    tier.close()
    again = disk_tier(tmp_path)  # a new process on the same directory
    assert again.num_entries == 3 and again.lookup([11, 12, 13, 14]) == 3 and again.lookup([14, 11]) == 0
    dst = caches(seed=5)
    load(again, dst, [4, 5, 6], [11, 12, 13])
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(dk[4:7], sk[1:4]) and torch.equal(dv[4:7], sv[1:4])
    assert again.num_loaded == 3
    again.close()


def test_queued_saves_are_hits_before_they_reach_the_disk(tmp_path, monkeypatch) -> None:
    tier = disk_tier(tmp_path)
    release = threading.Event()
    write = tier._write
    monkeypatch.setattr(tier, "_write", lambda key, payload: (release.wait(10), write(key, payload)))
    rows, _ = gather_blocks(kv_block_tensors(caches()), [1])
    tier.put([7], rows)  # the writer is held back
    assert tier.contains(7) and tier.lookup([7]) == 1 and not os.listdir(tmp_path)
    tier.claim([7])
    assert torch.equal(tier.take(7), rows[0])
    release.set()
    tier.close()
    assert tier.num_stored == 1 and len(os.listdir(tmp_path)) == 1


def _only_file(path) -> str:
    (name,) = [n for n in os.listdir(path) if n.endswith(".kv")]
    return os.path.join(path, name)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage", "wrong-key", "huge", "fifo", "symlink"])
def test_damaged_files_are_misses_and_removed(tmp_path, damage, caplog) -> None:
    tier = disk_tier(tmp_path)
    save(tier, caches(), [1], [42])
    tier.close()
    path = _only_file(tmp_path)
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[: len(data) - 10]
    elif damage == "flip":
        data[-1] ^= 0x01  # one bit of the payload
    elif damage == "empty":
        data = bytearray()
    elif damage == "garbage":
        data = bytearray(b"x" * len(data))
    elif damage == "wrong-key":  # a valid file under another key's name
        os.rename(path, path.replace("-2a.kv", "-2b.kv"))
        path = path.replace("-2a.kv", "-2b.kv")
    if damage in ("huge", "fifo", "symlink"):  # another writer's doing: read whole, a read that never returns
        os.unlink(path)
        if damage == "huge":
            os.truncate(os.open(path, os.O_CREAT | os.O_WRONLY), 1 << 34)  # (sparse: 16 GiB read whole before)
        elif damage == "fifo":
            os.mkfifo(path)
        else:
            os.symlink("/dev/zero", path)  # (read_bytes read it until memory ran out)
    elif damage != "wrong-key":
        open(path, "wb").write(bytes(data))
    again = disk_tier(tmp_path)
    key = 43 if damage == "wrong-key" else 42
    looked: list[int] = []
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        reader = threading.Thread(target=lambda: looked.append(again.lookup([key])), daemon=True)
        reader.start()
        reader.join(timeout=10)
    assert looked == [0]
    assert not os.path.lexists(path) and again.num_invalid == 1 and not again.contains(key)
    assert "recomputing instead" in caplog.text


def test_foreign_fingerprint_is_a_miss(tmp_path) -> None:
    tier = disk_tier(tmp_path, fingerprint=FP)
    save(tier, caches(), [1], [42])
    tier.close()
    path = _only_file(tmp_path)
    other = disk_tier(tmp_path, fingerprint=FP.replace("bf16", "fp32"))
    assert other.num_entries == 0 and other.lookup([42]) == 0  # its files are named apart
    # The same name, but written under another fingerprint (a renamed or crafted file).
    os.rename(path, path.replace(tier._prefix, other._prefix))
    other = disk_tier(tmp_path, fingerprint=FP.replace("bf16", "fp32"))
    assert other.num_entries == 1 and other.lookup([42]) == 0 and other.num_invalid == 1
    assert not os.listdir(tmp_path)


def test_wrong_block_size_is_a_miss(tmp_path) -> None:
    tier = disk_tier(tmp_path)
    save(tier, caches(), [1], [42])
    tier.close()
    entry = block_nbytes(kv_block_tensors(caches()))
    other = disk_tier(tmp_path, entry_bytes=entry * 2)  # same fingerprint string, other layout size
    assert other.lookup([42]) == 0 and other.num_invalid == 1


def test_half_written_files_are_never_read(tmp_path) -> None:
    """A writer killed mid-write leaves only its temporary file, which no lookup reads."""
    tier = disk_tier(tmp_path)
    save(tier, caches(), [1], [42])
    tier.close()
    path = _only_file(tmp_path)
    from pagedserve.worker.kv_offload import _writer_tag

    tmp = os.path.join(tmp_path, f".tmp-{_writer_tag()}-456-2a")  # a live writer's (this process)
    os.rename(path, tmp)
    again = disk_tier(tmp_path)
    assert again.num_entries == 0 and again.lookup([42]) == 0
    os.utime(tmp, (0, 0))  # one that has not moved for longer than any write takes
    disk_tier(tmp_path)
    assert not os.listdir(tmp_path)


def test_other_softwares_temporary_files_are_left_alone(tmp_path) -> None:
    """Any old ".tmp-*" file was removed at start: another program's in a shared directory too."""
    theirs = tmp_path / ".tmp-userdata.txt"
    theirs.write_text("important")
    os.utime(theirs, (0, 0))
    disk_tier(tmp_path)
    assert theirs.read_text() == "important"


def test_directory_stays_under_its_bound_least_recent_out(tmp_path) -> None:
    entry = block_nbytes(kv_block_tensors(caches()))
    file_bytes = entry + 96
    tier = disk_tier(tmp_path, capacity=3 * file_bytes)
    kv = caches()
    save(tier, kv, [1, 2, 3], [1, 2, 3])
    assert tier.lookup([1]) == 1  # 1 is now the most recent
    save(tier, kv, [4], [4])
    assert tier.num_entries == 3 and not tier.contains(2) and tier.contains(1)
    assert sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path)) <= 3 * file_bytes
    tier.close()
    again = disk_tier(tmp_path, capacity=2 * file_bytes)  # a smaller bound on restart
    assert again.num_entries == 2 and len(os.listdir(tmp_path)) == 2


def test_two_tiers_share_a_directory(tmp_path) -> None:
    a, b = disk_tier(tmp_path), disk_tier(tmp_path)
    kv = caches()
    save(a, kv, [1], [1])
    save(b, kv, [1, 2], [1, 2])  # the same key written twice: both whole
    c = disk_tier(tmp_path)
    assert c.lookup([1, 2]) == 2 and c.num_invalid == 0
    a.close(), b.close(), c.close()


def test_unwritable_directory_turns_the_tier_off(tmp_path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        tier = disk_tier(blocker / "kv")
    assert not tier.enabled and caplog.text.count("KV offload to disk is off") == 1
    kv = caches()
    save(tier, kv, [1], [1])  # dropped, no error
    assert tier.lookup([1]) == 0 and not tier.contains(1) and tier.num_dropped == 1


def test_a_failing_write_turns_the_tier_off_once(tmp_path, caplog, monkeypatch) -> None:
    tier = disk_tier(tmp_path)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier, "_write", full)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        save(tier, caches(), [1, 2], [1, 2])
        save(tier, caches(), [3], [3])
    assert not tier.enabled and caplog.text.count("No space left on device") == 1
    assert tier.lookup([1]) == 0


def test_host_tier_is_bounded_lru() -> None:
    kv = caches()
    entry = block_nbytes(kv_block_tensors(kv))
    tier = HostKVTier(2 * entry, entry)
    save(tier, kv, [1, 2], [1, 2])
    assert tier.lookup([1, 2]) == 2
    tier.claim([1])  # 1 becomes the most recent
    save(tier, kv, [3], [3])
    assert tier.contains(1) and not tier.contains(2) and tier.contains(3)
    dst = caches(seed=3)
    scatter_blocks(kv_block_tensors(dst), [5], [tier.take(1)])
    assert torch.equal(dst[1][1][5], kv[1][1][1])


def test_make_kv_tier_picks_by_configuration(tmp_path) -> None:
    assert make_kv_tier(None, None, False, 100, FP) is None
    assert isinstance(make_kv_tier(None, None, True, 100, FP), HostKVTier)
    assert make_kv_tier(None, 1000, False, 100, FP).capacity_bytes == 1000
    disk = make_kv_tier(str(tmp_path), None, False, 100, FP)
    assert isinstance(disk, DiskKVTier) and disk.capacity_bytes == 8 * 2**30
    disk.close()
    with pytest.raises(ValueError, match="holds not even one block"):
        make_kv_tier(None, 10, False, 100, FP)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_two_loads_of_one_key_in_a_step(tmp_path, kind) -> None:
    """Two requests resuming with the same prefix both load it."""
    kv = caches()
    entry = block_nbytes(kv_block_tensors(kv))
    tier = HostKVTier(10 * entry, entry) if kind == "host" else disk_tier(tmp_path)
    save(tier, kv, [1], [9])
    for _ in range(2):
        assert tier.lookup([9]) == 1
        tier.claim([9])
    assert torch.equal(tier.take(9), tier.take(9))
    with pytest.raises(KeyError):
        tier.take(9)


def test_payloads_are_separate_allocations() -> None:
    """A tier frees entries one by one: no payload may keep a whole step's rows alive."""
    rows, _ = gather_blocks(kv_block_tensors(caches()), [1, 2, 3])
    assert len({row.untyped_storage().data_ptr() for row in rows}) == 3
    assert all(row.untyped_storage().nbytes() == row.numel() for row in rows)


def test_one_lookup_larger_than_the_staging_bound_is_claimed_whole(tmp_path, monkeypatch) -> None:
    import pagedserve.worker.kv_offload as kv_offload

    tier = disk_tier(tmp_path)
    kv = caches()
    save(tier, kv, [1, 2, 3, 4], [1, 2, 3, 4])
    monkeypatch.setattr(kv_offload, "_MAX_STAGED_BYTES", tier.entry_bytes)  # room for one staged entry
    assert tier.lookup([1, 2]) == 2  # staged, never claimed (the admission did not fit)
    assert tier.lookup([3, 4]) == 2  # drops what the last lookup left, keeps its own
    tier.claim([3, 4])
    dst = caches(seed=2)
    scatter_blocks(kv_block_tensors(dst), [5, 6], [tier.take(3), tier.take(4)])
    assert torch.equal(dst[0][0][5:7], kv[0][0][3:5])
    tier.close()


def test_turning_off_keeps_what_a_lookup_already_verified(tmp_path) -> None:
    tier = disk_tier(tmp_path)
    save(tier, caches(), [1], [1])
    assert tier.lookup([1]) == 1
    tier._disable("the disk filled up")  # noqa: SLF001 - the writer thread's path
    tier.claim([1])  # the admission that followed the lookup still gets its block
    assert tier.take(1).numel() == tier.entry_bytes and tier.lookup([1]) == 0


def test_files_identity_changes_with_the_weights(tmp_path) -> None:
    """The weights and config, not the tokenizer or template (which change no token's KV)."""
    from pagedserve.worker.kv_offload import files_identity

    (tmp_path / "model.safetensors").write_bytes(b"a" * 10)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    before = files_identity(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    assert files_identity(str(tmp_path)) == before
    (tmp_path / "model.safetensors").write_bytes(b"b" * 11)
    assert files_identity(str(tmp_path)) != before and files_identity("smollm2-135m-instruct") == ""


def test_other_fingerprints_files_count_toward_the_bound_and_go_first(tmp_path) -> None:
    """The bound is the directory's: another fingerprint's files (another model, setting,
    or weights since replaced) were neither counted nor evicted, so each change of
    fingerprint left a whole bound behind.  Odd spellings of a block name count too."""
    file_bytes = block_nbytes(kv_block_tensors(caches())) + 96
    old = disk_tier(tmp_path, capacity=3 * file_bytes, fingerprint=FP + "|old")
    save(old, caches(), [1, 2, 3], [1, 2, 3])
    old.close()
    odd = tmp_path / (old._prefix + "00AB.kv")  # (a name no writer makes: not its key 0xab's)
    odd.write_bytes(b"x")
    new = disk_tier(tmp_path, capacity=3 * file_bytes)
    assert len(os.listdir(tmp_path)) == 3  # the oldest foreign ones went at start
    save(new, caches(), [1, 2], [7, 8])
    names = os.listdir(tmp_path)
    assert len(names) == 3 and sum(n.startswith(new._prefix) for n in names) == 2
    assert new.lookup([7, 8]) == 2
    new.close()


def test_the_bound_holds_while_a_file_is_written(tmp_path, monkeypatch) -> None:
    """Room is made before a write (the new file was renamed in, then the oldest removed)."""
    file_bytes = block_nbytes(kv_block_tensors(caches())) + 96
    tier = disk_tier(tmp_path, capacity=2 * file_bytes)
    seen = []
    write = tier._write

    def counting(key, row):
        seen.append(len([n for n in os.listdir(tmp_path) if n.endswith(".kv")]))
        write(key, row)

    monkeypatch.setattr(tier, "_write", counting)
    for key in (1, 2, 3, 4):
        save(tier, caches(), [key], [key])
    assert seen == [0, 1, 1, 1] and tier.num_entries == 2
    tier.close()


def test_a_name_taken_by_a_directory_drops_that_block_and_the_tier_goes_on(tmp_path) -> None:
    """A directory made at a block's file name failed the rename and turned the tier off."""
    tier = disk_tier(tmp_path)
    os.mkdir(tier._path(5))
    save(tier, caches(), [1, 2], [5, 6])
    assert tier.enabled and tier.num_dropped == 1 and tier.lookup([6]) == 1 and not tier.contains(5)
    tier.close()


def test_a_bound_under_one_file_is_refused(tmp_path) -> None:
    entry = block_nbytes(kv_block_tensors(caches()))
    with pytest.raises(ValueError, match=r"holds not even one block \(\d+ bytes as stored\)"):
        disk_tier(tmp_path, capacity=entry + 10)


def test_a_killed_writers_temporary_files_are_removed_at_start(tmp_path) -> None:
    """A writer killed mid-write (SIGKILL) leaves ".tmp-PID-..." behind: the next tier on
    the directory removes it when PID is gone and the file is older than a write takes
    (a fresh one may be a live writer's in a container sharing this host's name), and
    keeps a live writer's."""
    import subprocess

    from pagedserve.worker.kv_offload import _writer_tag

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = _writer_tag().partition("_")[2]
    leftover = tmp_path / f".tmp-{dead.pid}_{host}-1-abc"
    live = tmp_path / f".tmp-{_writer_tag()}-1-def"
    elsewhere = tmp_path / f".tmp-{dead.pid}_otherhost-1-abc"  # another host's writer: its pid means nothing here
    fresh = tmp_path / f".tmp-{dead.pid}_{host}-2-abc"
    for path in (leftover, live, elsewhere, fresh):
        path.write_bytes(b"partial")
        if path is not fresh:
            os.utime(path, (time.time() - 60, time.time() - 60))
    disk_tier(tmp_path)
    assert not leftover.exists() and live.exists() and elsewhere.exists() and fresh.exists()


def test_a_link_planted_under_a_temporary_name_writes_nothing_outside(tmp_path) -> None:
    """The start-up probe's name is predictable (".tmp-PID_HOST-probe"): a symlink planted
    there had its target outside the directory truncated to 0 bytes."""
    import pagedserve.worker.kv_offload as kv_offload

    victim = tmp_path / "victim.txt"
    victim.write_text("not the tier's to touch")
    directory = tmp_path / "tier"
    directory.mkdir()
    (directory / f".tmp-{kv_offload._writer_tag()}-probe").symlink_to(victim)  # noqa: SLF001 - the name planted
    tier = disk_tier(directory)
    save(tier, caches(), [1], [1])
    tier.close()
    assert victim.read_text() == "not the tier's to touch" and tier.lookup([1]) == 1


def test_the_blocks_behind_a_damaged_one_are_saved_again_once_recomputed(tmp_path) -> None:
    """They hang off its hash chain: unreachable until it is saved again, yet indexed, so
    when recomputed they were never saved again (a damaged directory healed one block per
    prompt prefix per restart).  Now they go with it, and all are saved on recomputation."""
    tier = disk_tier(tmp_path)
    kv = caches()
    save(tier, kv, [1, 2, 3], [7, 8, 9])
    tier.close()
    first = tier._path(7)  # noqa: SLF001 - the file to damage
    data = bytearray(first.read_bytes())
    data[-1] ^= 0x01
    first.write_bytes(bytes(data))
    again = disk_tier(tmp_path)
    assert again.lookup([7, 8, 9]) == 0
    assert not any(again.contains(key) for key in (7, 8, 9))  # (8 and 9 were still indexed)
    save(again, kv, [1, 2, 3], [7, 8, 9])
    again.close()
    third = disk_tier(tmp_path)
    assert third.lookup([7, 8, 9]) == 3
    third.close()
