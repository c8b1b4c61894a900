"""The tensor-parallel checkpoints of tests/distributed, shared with the executor tests."""

from tests.distributed.conftest import tp_checkpoint  # noqa: F401
