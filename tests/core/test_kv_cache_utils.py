import os
import subprocess
import sys

from pagedserve.core.kv_cache_utils import (
    NONE_HASH,
    extend_block_hashes,
    hash_block_tokens,
    hash_request_tokens,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_equal_inputs_equal_hash():
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, (1, 2, 3, 4))
    assert hash_block_tokens(5, [1, 2], ("salt",)) == hash_block_tokens(5, [1, 2], ("salt",))


def test_parent_tokens_and_extra_keys_change_hash():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(base, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != hash_block_tokens(None, [1, 2, 3, 4], ("b",))
    assert hash_block_tokens(1, [7]) != hash_block_tokens(2, [7])
    # Token/extra boundary and token count are part of the input.
    assert hash_block_tokens(None, [0, 0]) != hash_block_tokens(None, [0])
    assert hash_block_tokens(None, [1], (2,)) != hash_block_tokens(None, [1, 2])
    # None parent is the fixed root, not zero.
    assert hash_block_tokens(None, [3]) == hash_block_tokens(NONE_HASH, [3])
    assert hash_block_tokens(0, [3]) != hash_block_tokens(None, [3])


def test_hash_is_stable_across_processes():
    """A real hash, not Python's per-process salted hash()."""
    code = "from pagedserve.core.kv_cache_utils import hash_block_tokens as h; print(h(None, [1, 2, 3], ('s',)))"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
        outs.add(int(res.stdout))
    assert outs == {hash_block_tokens(None, [1, 2, 3], ("s",))}


def test_chain_covers_only_full_blocks_and_extends_incrementally():
    tokens = list(range(10))
    chain = hash_request_tokens(tokens, 4)
    assert len(chain) == 2
    assert chain[0] == hash_block_tokens(None, tokens[0:4])
    assert chain[1] == hash_block_tokens(chain[0], tokens[4:8])
    # Extending reuses existing entries (a sentinel proves nothing is recomputed).
    partial = [123]
    extend_block_hashes(partial, tokens + [10, 11], 4)
    assert partial[0] == 123 and len(partial) == 3
    assert partial[1] == hash_block_tokens(123, [4, 5, 6, 7])
    assert partial[2] == hash_block_tokens(partial[1], [8, 9, 10, 11])
    capped = extend_block_hashes([], tokens, 4, num_full_blocks=1)
    assert capped == chain[:1]


def test_salt_goes_into_the_chain():
    tokens = list(range(8))
    plain = hash_request_tokens(tokens, 4)
    salted = hash_request_tokens(tokens, 4, cache_salt="tenant-a")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert salted == hash_request_tokens(tokens, 4, cache_salt="tenant-a")


def test_core_imports_no_torch():
    code = (
        "import sys; import pagedserve.core.scheduler, pagedserve.core.kv_cache_manager; "
        "print('torch' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"
