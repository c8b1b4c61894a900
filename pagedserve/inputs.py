"""vLLM's prompt types (`vllm.inputs.TextPrompt` / `TokensPrompt`), so that scripts
written for vLLM's offline API import them from here: plain dicts, as
`LLM.generate` takes them (engine/input_processor.PROMPT_KEYS is what it reads)."""

from __future__ import annotations

from typing import Any, TypedDict


class _PromptExtras(TypedDict, total=False):
    multi_modal_data: dict[str, Any]  # {"image": an image or a list of them}
    cache_salt: str  # prefix-cache isolation: only prompts with the same salt share blocks


class TextPrompt(_PromptExtras):
    """A prompt as text, tokenized by the engine."""

    prompt: str


class TokensPrompt(_PromptExtras):
    """A prompt as token ids, used as given."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
