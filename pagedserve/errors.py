"""The exception types a request can be refused with, whichever layer refuses it.

InvalidRequestError is a ValueError (what the offline API promises for bad input) that
also names the field at fault, so the OpenAI server can answer 400 with `param` set
without re-deriving which field a message is about.  OverloadedError is a shared
resource saturated for now (HTTP 503 with Retry-After).
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    code: str | None = None  # OpenAI's error code for this kind of refusal, where it has one

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ImageInputError(InvalidRequestError):
    """A request's image is refused (a bound, its format, a model without image input):
    the message names the problem on its own, never as a chat-template failure."""


def text_model_image_error(model: str | None = None, param: str = "messages") -> ImageInputError:
    """A text model's answer to an image: `model` the name a client asked for (a server's;
    the model's path, the operator's, is never in it)."""
    which = "this model" if model is None else f"model {model[:100]!r}"
    return ImageInputError(f"{which} takes no images: it is a text model; image input needs a vision-language "
                           "model", param=param)


# How vLLM's refusal of a prompt the context cannot hold begins (clients match it).
CONTEXT_LENGTH_ERROR = "This model's maximum context length is"


class PromptTooLongError(InvalidRequestError):
    """A prompt longer than the context can hold, by its tokens or by its characters
    before they are counted: a refusal a caller may answer by cutting the prompt, as the
    Responses API's truncation "auto" does."""

    code = "context_length_exceeded"  # (a check of prompt + max_tokens in the API layer sends it too)


class OverloadedError(RuntimeError):
    """Too much is queued for a shared resource; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after
