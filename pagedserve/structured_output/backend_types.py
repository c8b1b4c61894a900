"""What the structured-output manager needs of a grammar library, and the choice of one.

Two libraries implement it: llguidance (`backend_guidance.py`) and xgrammar
(`backend_xgrammar.py`).  Both fill the same token bitmask (int32 words, bit i of a row
set = token i allowed), so everything after the mask -- applying it to the logits,
the scheduler's matcher calls -- is the same whichever one runs.

Why "auto" means llguidance here (measured on the 2-core development CPU, SmolLM2's
49k vocabulary; docs/performance.md "Structured outputs"): xgrammar precomputes a token mask for
every grammar state at compile time, which takes ~0.3-0.45 s for a small JSON schema
with one bounded string (`maxLength: 24`) and 410 s for a 200-field schema of bounded
strings; llguidance builds its parser lazily and computes masks on demand, 2 ms and
10 ms to compile the same two, so a request with a new schema starts about as soon as
one without.  Its masks cost more per step for simple grammars (~16-200 us a row vs
xgrammar's ~20 us without bounded strings), which a CPU step of tens of milliseconds
does not feel.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pagedserve.config import StructuredOutputsConfig

AUTO_BACKEND = "guidance"


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar forbids it."""
        ...

    def refusal(self) -> str | None:
        """Why the library refused the last token, where it says (a lexer out of fuel)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended and a stop token has been accepted: nothing may follow."""
        ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar of a `StructuredOutputsParams.key`; a spec the library
        refuses raises ValueError carrying its message, for the client."""
        ...

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher (at the grammar's start) over a compiled grammar."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, rows: list[tuple[GrammarMatcher, int]]) -> None:
        """Write each matcher's allowed next tokens into its row of `bitmask`."""
        ...


def resolve_backend_name(name: str) -> str:
    StructuredOutputsConfig(backend=name)  # the one check of the name
    return AUTO_BACKEND if name == "auto" else name


def create_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
    """The backend `name` ("auto" resolved) over `tokenizer`; indexing the vocabulary
    takes a fraction of a second, so the manager does it on its first grammar."""
    from pagedserve.model_loader.tokenizer_snapshot import hf_tokenizer

    name = resolve_backend_name(name)
    if name == "guidance":  # reads the Rust tokenizer itself: transformers is not imported for it
        from pagedserve.structured_output.backend_guidance import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    tokenizer = hf_tokenizer(tokenizer)  # xgrammar indexes transformers' own tokenizer object
    from pagedserve.structured_output.backend_xgrammar import XgrammarBackend

    return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
