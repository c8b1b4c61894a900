"""The one exception type for a request the engine refuses.

It is a ValueError (what the offline API promises for bad input) that also names the
field at fault, so the OpenAI server can answer 400 with `param` set without
re-deriving which field a message is about.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
