"""The models area's tiny-checkpoint fixture, shared with the loader tests."""

from tests.models.conftest import tiny_checkpoint  # noqa: F401
