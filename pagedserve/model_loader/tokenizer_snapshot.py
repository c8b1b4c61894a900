"""A fast tokenizer's state, saved once, served without importing transformers.

Why: importing transformers costs ~0.5 s of every start and building its tokenizer
~0.25 s more (SmolLM2; Zen 4, AVX-512 with native bf16), a fifth of `pagedserve generate`'s wall time, while what
the engine asks of a tokenizer is the Rust `tokenizers.Tokenizer`'s work plus a few
names (special tokens and their ids) and the chat template.  So for the tokenizer
directories pagedserve itself wrote (a GGUF's conversion, a registered model's), the first
start loads transformers' tokenizer as before and saves its backend exactly as that
tokenizer left it (special tokens added, post-processor rebuilt), its special tokens and
its template; later starts build a `SnapshotTokenizer` from that file.

Only a plain fast tokenizer is saved (the generic class, no space clean-up on decode, no
special-token splitting), and only after probe texts encode and decode the same both
ways; anything else stays transformers'.  Callers that need transformers' own object
(structured-output backends index it; `LLM.get_tokenizer()` returns it) call
`hf_tokenizer`, which loads it from the directory on first use.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from pagedserve.chat_template import render_chat_template
from pagedserve.model_loader.sources import cache_dir, content_cache_key, publish_cache_json

logger = logging.getLogger(__name__)

# tokenizer_config.json's tokenizer_class of a plain fast tokenizer (transformers 5, 4).
GENERIC_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model-specific classes that are a tokenizers backend with their settings in its JSON:
# snapshotted too, each snapshot checked against transformers' own before it is saved
# (Gemma 3's 262k-token tokenizer: 5.7 s through AutoTokenizer, 2.3 s from a snapshot).
CHECKED_FAST_TOKENIZERS = ("GemmaTokenizer",)
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id")
# Texts a snapshot must encode and decode as transformers does before it is saved (the
# special tokens' own texts are added per tokenizer).
_PROBES = ("What is the capital of France?", "  spaces\tand\nnewlines  ", "naïve café 🚀 東京",
           "def f(x):\n    return x ** 2  # ok", "<unk> <s></s> [INST] <|endoftext|>", "")


# Text past this many characters is tokenized without holding the interpreter's lock.
LONG_TEXT_CHARS = 4096


class SnapshotTokenizer:
    """The part of a transformers fast tokenizer the engine uses, over the same Rust
    tokenizer: `encode`, `decode`, `get_vocab`, `len`, `convert_tokens_to_ids` and back, the
    special tokens (`special_tokens_map`, `eos_token_id` and the other ids) and
    `apply_chat_template(..., tokenize=False)`.  `hf_tokenizer()` is transformers' own."""

    clean_up_tokenization_spaces = False  # (only such tokenizers are saved)

    def __init__(self, directory: str, saved: dict[str, Any], hf: Any = None) -> None:
        """`saved`: what `snapshot_state` gave; `hf`: transformers' tokenizer, where the
        caller has it already."""
        from tokenizers import Tokenizer

        self.directory = directory
        self.backend_tokenizer = Tokenizer.from_str(saved["backend"])
        self.backend_tokenizer.no_truncation()
        self.backend_tokenizer.no_padding()
        self.special_tokens_map: dict[str, str] = dict(saved["special_tokens_map"])
        self.chat_template: str | None = saved["chat_template"]
        ids = saved["ids"]
        self.bos_token_id: int | None = ids["bos_token_id"]
        self.eos_token_id: int | None = ids["eos_token_id"]
        self.unk_token_id: int | None = ids["unk_token_id"]
        self.pad_token_id: int | None = ids["pad_token_id"]
        self.bos_token: str | None = self.special_tokens_map.get("bos_token")
        self.eos_token: str | None = self.special_tokens_map.get("eos_token")
        self.tokenizer_class: str | None = saved.get("tokenizer_class")  # transformers' class it was made of
        # The vocabulary's longest entry in characters, counted when the snapshot was made:
        # get_vocab() builds a 262k-entry dict for Gemma 3 (~0.25 s of every start).
        self.longest_token_chars: int = saved["longest_token_chars"]
        self._hf: Any = hf
        self._hf_lock = threading.Lock()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Long text goes through the Rust tokenizer's encode_batch, the same pipeline,
        which lets go of the interpreter's lock while it works (its encode holds it: a
        3M-character prompt stopped every other thread, the event loop's too, for 0.9 s;
        through encode_batch the longest pause was 0.02 s, Zen 5)."""
        if len(text) > LONG_TEXT_CHARS:
            return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int] | int, *, skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        """The added tokens (text -> id), as transformers' fast tokenizers give them."""
        return {t.content: i for i, t in sorted(self.backend_tokenizer.get_added_tokens_decoder().items())}

    def convert_tokens_to_ids(self, token: str) -> int | None:
        found = self.backend_tokenizer.token_to_id(token)
        return self.unk_token_id if found is None else found

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """Each id's vocabulary string (byte-level BPE's "Ġthe", not decoded text)."""
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            **kwargs: Any) -> str | list[int]:
        """As transformers' for one conversation (its template variables are the special
        tokens, then `kwargs`); `tokenize=True` gives the ids without adding special tokens."""
        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template and none was given")
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        text = render_chat_template(template, conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle carries (a data-parallel replica sends its tokenizer to the front
        end): not the lock, nor transformers' tokenizer, which the other side loads if asked."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_hf", "_hf_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _hf=None, _hf_lock=threading.Lock())

    def hf_tokenizer(self) -> Any:
        """transformers' tokenizer of the same directory (loaded on the first call; its
        chat template is this one's, which a caller may have replaced)."""
        with self._hf_lock:
            if self._hf is None:
                self._hf = _load_hf(self.directory, self.tokenizer_class)
            self._hf.chat_template = self.chat_template
            return self._hf


def hf_tokenizer(tokenizer: Any) -> Any:
    """transformers' tokenizer behind `tokenizer` (itself unless it is a snapshot)."""
    return tokenizer.hf_tokenizer() if isinstance(tokenizer, SnapshotTokenizer) else tokenizer


def longest_token_chars(tokenizer: Any) -> int:
    """The longest entry of `tokenizer`'s vocabulary (added tokens included), in characters."""
    if isinstance(tokenizer, SnapshotTokenizer):
        return tokenizer.longest_token_chars
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def cached_tokenizer(directory: str, tokenizer_class: str | None = None) -> Any:
    """The tokenizer a directory pagedserve wrote holds: a `SnapshotTokenizer` (the one an
    earlier start saved for the directory as it is now, else one made from transformers'
    tokenizer and saved for the next start), so that the first start runs what later ones
    run; transformers' own where a snapshot would not behave the same."""
    key = _snapshot_key(directory)
    path = os.path.join(cache_dir(), "tokenizer-snapshots", f"{key}.json")
    try:
        with open(path) as f:
            return SnapshotTokenizer(directory, json.load(f))
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - a torn or foreign file (tokenizers raises its own types): redo it
        logger.warning("cannot read the saved tokenizer %s (%s: %s); loading the directory's again",
                       path, type(e).__name__, e)
    tokenizer = _load_hf(directory, tokenizer_class)
    saved = snapshot_state(tokenizer)
    if saved is None:
        return tokenizer
    snapshot = SnapshotTokenizer(directory, saved, hf=tokenizer)
    differs = _differs(snapshot, tokenizer)
    if differs:
        logger.info("tokenizer of %s not saved for later starts (%s differs)", directory, differs)
        return tokenizer
    publish_cache_json(path, saved, "tokenizer")
    return snapshot


# Every file a plain fast tokenizer's load reads from its directory (config.json names the
# class where tokenizer_config.json does not).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "config.json")


def _snapshot_key(directory: str) -> str:
    """The bytes of the directory's tokenizer files (`TOKENIZER_FILES`, those present),
    transformers' version and this module's code (a change to how snapshots are made makes
    new ones).  Not the directory's path: a copied or moved directory (each test's fresh
    one, whose first load imported transformers) reads the snapshot, and the cache does
    not grow by one per path.  Hashing Gemma 3's 33 MB tokenizer.json is ~20 ms of a
    2.3 s load."""
    with open(__file__, "rb") as f:
        code = hashlib.sha256(f.read()).hexdigest()
    files = [n for n in TOKENIZER_FILES[1:] if os.path.exists(os.path.join(directory, n))]
    return content_cache_key(os.path.join(directory, TOKENIZER_FILES[0]), importlib.metadata.version("transformers"),
                             code, *(f"{n} {content_cache_key(os.path.join(directory, n))}" for n in files))


def _load_hf(directory: str, tokenizer_class: str | None = None) -> Any:
    if tokenizer_class in CHECKED_FAST_TOKENIZERS:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, trust_remote_code=False)  # (no auto_map code, no prompt)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory)


def snapshot_state(tokenizer: Any) -> dict[str, Any] | None:
    """What a SnapshotTokenizer needs of `tokenizer`, or None where it would not be the same."""
    if (type(tokenizer).__name__ not in (*GENERIC_FAST_TOKENIZERS, *CHECKED_FAST_TOKENIZERS)
            or tokenizer.clean_up_tokenization_spaces
            or tokenizer.split_special_tokens
            or not isinstance(tokenizer.chat_template, (str, type(None)))):
        return None
    specials = tokenizer.special_tokens_map
    if not all(isinstance(v, str) for v in specials.values()):  # (lists of extra special tokens)
        return None
    return {"backend": tokenizer.backend_tokenizer.to_str(), "special_tokens_map": dict(specials),
            "chat_template": tokenizer.chat_template, "ids": {n: getattr(tokenizer, n) for n in _SPECIAL_IDS},
            "tokenizer_class": type(tokenizer).__name__, "longest_token_chars": longest_token_chars(tokenizer)}


def _differs(snapshot: SnapshotTokenizer, tokenizer: Any) -> str:
    """The first thing the snapshot does otherwise than `tokenizer` on the probes ("" if none)."""
    texts = [*_PROBES, " ".join(snapshot.special_tokens_map.values())]
    checks: list[tuple[str, Callable[[Any], Any]]] = [
        ("len", len), ("vocabulary", lambda t: t.get_vocab()),
        *((f"encode {t!r}", lambda tok, t=t, a=a: tok.encode(t, add_special_tokens=a))
          for t in texts for a in (True, False)),
        *((f"decode {t!r}", lambda tok, t=t, s=s: tok.decode(tokenizer.encode(t), skip_special_tokens=s))
          for t in texts for s in (True, False)),
    ]
    for what, check in checks:
        if check(snapshot) != check(tokenizer):
            return what
    return ""
