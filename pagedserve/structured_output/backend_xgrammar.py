"""xgrammar: grammars compiled ahead into per-state token masks (fast masks, slow
compiles for bounded repetitions such as a string's maxLength)."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

# xgrammar errors start with "[HH:MM:SS] /path/file.cc:LINE: "; the client needs the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class XgrammarMatcher:
    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        self._m = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def refusal(self) -> str | None:
        return None  # (xgrammar says only True or False)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._stop_token_ids = stop_token_ids
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        # Its own cache is off: the manager caches compiled grammars by spec, bounded.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        c = self._compiler
        try:
            if kind == "json":
                return c.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(spec)))
            if kind == "structural_tag":
                return c.compile_structural_tag(spec)
            return c.compile_grammar(spec)
        except (RuntimeError, ValueError) as e:
            text = str(e).strip()
            raise ValueError(_XGRAMMAR_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__) from None

    def new_matcher(self, compiled: Any) -> XgrammarMatcher:
        return XgrammarMatcher(compiled, self._stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, rows: list[tuple[Any, int]]) -> None:
        for matcher, row in rows:
            matcher._m.fill_next_token_bitmask(bitmask, row)
