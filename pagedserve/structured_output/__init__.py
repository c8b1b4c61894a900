"""Structured outputs: grammars compiled off the engine loop, one matcher per request,
one token bitmask per step.  The grammar library is a backend (backend_types.py says
why llguidance is the default and xgrammar the alternative).

The parts, and where each runs:
- `StructuredOutputManager.compile(params)` (any thread): submits the grammar to a
  small thread pool, keyed by its spec, and returns a future; equal specs share one
  compilation (a bounded LRU cache; `claim` is the lookup of a request entering the
  engine, the one that counts cache hits).  `AsyncLLM` and `LLM` await it before they
  hand the request to the engine, so an invalid schema, regex or grammar is a
  ValueError (a 400 on the server) carrying the compiler's message, decided before the
  request takes a KV block; and a slow one never stops the engine loop.
- `StructuredOutputManager.request(params)`: the per-request state (a matcher over the
  compiled grammar) the scheduler sees through `core.request.GrammarState`.  A request
  whose grammar is still compiling waits in WAITING_FOR_FSM, skipped by the scheduler.
- `StructuredOutputManager.fill_bitmask(...)`: after scheduling, the allowed next tokens
  of every constrained request that samples this step, one row each of a preallocated
  bitmask (rows in the order the runner samples); the runner applies it to the logits
  in place before sampling.  With overlap scheduling the forward is launched first and
  the mask is filled once the previous step's tokens have reached the matchers.
- The scheduler advances a matcher on every accepted token; a grammar that has reached
  its end finishes the request with "stop".
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.core.sched_output import GrammarBitmask
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_output.backend_types import (
    GrammarBackend,
    GrammarMatcher,
    create_backend,
    resolve_backend_name,
)
from pagedserve.structured_output.limits import check_spec

# Compiled grammars kept for reuse (a JSON schema's is tens of kB to a few MB), and the
# characters of their specs at most: a compiled grammar measured ~40x its spec (a 400 kB
# schema held 15.6 MB), and 256 large ones kept 4.2 GB for good.  The newest always stays.
GRAMMAR_CACHE_SIZE = 256
GRAMMAR_CACHE_SPEC_CHARS = 4 << 20
# os nice value of the compile threads (0 = the engine's; 19 = the least).
COMPILE_THREAD_NICE = 10
# Stack of each compile thread: grammar compilers recurse on the spec's shape, and 8 MiB
# overflowed (exit 139) at ~2,500 chained $refs; with this, 3,000 compile and 20,000 get
# llguidance's own "schema too large".  Virtual memory: pages are touched only as used.
COMPILE_THREAD_STACK_BYTES = 256 << 20
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "structural_tag": "structural tag"}


@dataclass(frozen=True)
class CompiledGrammar:
    """What a compile future resolves to: the grammar and the backend that reads it."""

    backend: GrammarBackend
    grammar: Any


class StructuredOutputRequest:
    """One request's grammar: compiled (or failing) in the background, then matched."""

    def __init__(self, compiled: Future, after_token: int | None = None,
                 forget: Callable[[], None] | None = None) -> None:
        self._compiled = compiled
        self._forget = forget  # drops the shared grammar from the cache
        self.matcher: GrammarMatcher | None = None
        self.error: str | None = None
        self.refusal: str | None = None
        # Until `after_token` is generated (a reasoning block's end) nothing is constrained.
        self.after_token = after_token

    def is_ready(self) -> bool:
        """Compiled (or failed: see `error`); never blocks."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        exc = self._compiled.exception()
        if exc is not None:
            self.error = str(exc)
            return True
        compiled: CompiledGrammar = self._compiled.result()
        self.matcher = compiled.backend.new_matcher(compiled.grammar)
        return True

    def constraining(self) -> bool:
        """Whether the next token must follow the grammar."""
        return self.matcher is not None and self.after_token is None and not self.matcher.is_terminated()

    def accept_token(self, token_id: int) -> bool:
        if self.after_token is not None:  # still before the constraint: only watch for its start
            if token_id == self.after_token:
                self.after_token = None
            return True
        if self.matcher.accept_token(token_id):
            return True
        # The library failed at run time (llguidance's lexer out of fuel on a grammar of
        # nested repeats): its reason goes to the client, and the shared grammar leaves the
        # cache (its lexer had grown 100-230 MB, kept per distinct grammar until evicted).
        self.refusal = self.matcher.refusal()
        if self._forget is not None:
            self._forget()
        return False

    def is_terminated(self) -> bool:
        return self.after_token is None and self.matcher.is_terminated()


def _large_stack_pool(workers: int) -> ThreadPoolExecutor:
    """A compile pool whose threads have COMPILE_THREAD_STACK_BYTES stacks: they are all
    started now, while the stack size is set (the executor starts threads as tasks
    arrive, and the size applies to threads started while it is set)."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedserve-grammar",
                              initializer=_lower_priority)
    started = threading.Barrier(workers + 1)
    previous = threading.stack_size(COMPILE_THREAD_STACK_BYTES)
    try:
        for _ in range(workers):  # each task holds its thread until all are started
            pool.submit(started.wait)
    finally:
        threading.stack_size(previous)
    started.wait()
    return pool


def _lower_priority() -> None:
    """Compile threads yield the CPU to the engine's step (Linux: per-thread nice);
    a compile then costs the running streams little even on a 2-core machine."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_THREAD_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_num_seqs: int,
                 backend: str = "auto", max_workers: int = 2) -> None:
        """`backend`: "auto", "guidance" or "xgrammar" (backend_types.py)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.max_num_seqs = max_num_seqs
        self.backend_name = resolve_backend_name(backend)
        self._pool = _large_stack_pool(max_workers)
        self._lock = threading.Lock()
        self._backend: GrammarBackend | None = None  # made on the first compile (indexes the vocabulary)
        # Making it may load transformers' tokenizer too (a snapshot's: ~1 s once, Zen 4 with
        # AVX-512 and native bf16): under a lock of its own, so the engine thread's
        # bookkeeping under `_lock` never waits on it.
        self._backend_lock = threading.Lock()
        # Least recently used first; bounded, since every client may send its own schema.
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_chars = 0  # its specs' characters
        self._served: set[tuple[str, str]] = set()  # cached specs some request has used
        self._bitmasks: list[torch.Tensor] = []
        self._turn = 0
        # Statistics for the log line and /metrics.
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0

    # ------------------------------------------------------------------ compiling
    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params`, as a future of a CompiledGrammar (thread-safe;
        cached by spec).  Its exception, if any, is an InvalidRequestError carrying the
        compiler's message."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this model has none",
                                      param="structured_outputs")
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():  # (a cancelled one is compiled again)
                self._cache.move_to_end(key)
                return future
            self._drop(key)  # (a cancelled one's)
            future = self._cache[key] = self._pool.submit(self._compile, key)
            self._cache_chars += len(key[1])
            while len(self._cache) > 1 and (len(self._cache) > GRAMMAR_CACHE_SIZE
                                            or self._cache_chars > GRAMMAR_CACHE_SPEC_CHARS):
                self._drop(next(iter(self._cache)))  # the least recently used; requests holding it keep it
        return future

    def claim(self, params: StructuredOutputsParams) -> Future:
        """`compile` for a request entering the engine (once per request, whatever its n):
        counts a cache hit when an earlier request already used this grammar.  Looking a
        spec up beforehand (to refuse a bad one early) does not count."""
        future = self.compile(params)
        with self._lock:
            if params.key in self._served:
                self.num_cache_hits += 1
            elif params.key in self._cache:
                self._served.add(params.key)
        return future

    def _get_backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = create_backend(self.backend_name, self.tokenizer, self.vocab_size,
                                               self.stop_token_ids)
            return self._backend

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        t0 = time.perf_counter()
        kind, spec = key
        try:
            check_spec(kind, spec)  # a spec past a bound never reaches the compiler (nor waits for it to load)
        except InvalidRequestError:
            self._forget(key)
            raise
        backend = self._get_backend()
        try:
            grammar = backend.compile(kind, spec)
        except Exception as e:  # noqa: BLE001 - grammar libraries raise what they like on a bad spec (a client's)
            self._forget(key)
            if isinstance(e, InvalidRequestError):
                raise
            # (llguidance's advice to enable its coerce_one_of option is not the client's to follow)
            message = str(e).replace(". Enable 'coerce_one_of' option to approximate oneOf with anyOf",
                                     " (anyOf is: each alternative may match)")
            raise InvalidRequestError(f"invalid {_KIND_NAMES[kind]}: {message}", param="structured_outputs") from None
        admits, failed = self._admits_a_token(backend, grammar)
        if not admits:
            self._forget(key)
            why = "it admits no value (a $ref that only refers to itself?)" if kind == "json" else "it admits no text"
            if failed and "NoExtensionBias" not in failed:  # (llguidance's word for "nothing can follow")
                # (its lexer out of room at the start masks all but the stop token: its reason, not "no text")
                why = f"the grammar library cannot start it ({failed})"
            raise InvalidRequestError(f"invalid {_KIND_NAMES[kind]}: {why}; the output would be empty",
                                      param="structured_outputs")
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - t0
        return CompiledGrammar(backend, grammar)

    def _admits_a_token(self, backend: GrammarBackend, grammar: Any) -> tuple[bool, str | None]:
        """Whether the grammar's start allows a token other than a stop token (a schema
        whose $ref cycle holds nothing else compiles, and its output was an empty text
        that finished as "stop"), and the matcher's failure there, if it failed."""
        mask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        matcher = backend.new_matcher(grammar)
        backend.fill_bitmask(mask, [(matcher, 0)])
        words = mask[0].numpy().view("uint32").copy()
        for token in self.stop_token_ids:
            if 0 <= token < self.vocab_size:
                words[token // 32] &= ~(1 << (token % 32)) & 0xFFFFFFFF
        return bool(words.any()), matcher.refusal()

    def _forget(self, key: tuple[str, str]) -> None:
        """A bad spec is not worth keeping."""
        with self._lock:
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        """`key` out of the cache, if there (under `_lock`)."""
        if self._cache.pop(key, None) is not None:
            self._cache_chars -= len(key[1])
        self._served.discard(key)

    def request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A fresh matcher state for one request (n > 1: one each) over the shared grammar."""
        return StructuredOutputRequest(self.compile(params), params.after_token,
                                       functools.partial(self._forget, params.key))

    # ------------------------------------------------------------------ per step
    def fill_bitmask(self, rows: dict[str, int],
                     grammars: dict[str, StructuredOutputRequest | None]) -> GrammarBitmask:
        """Rows `rows[req_id]` of a [max_num_seqs, vocab/32] bitmask from each request's matcher
        (a request finished meanwhile, `grammars[req_id] is None`, allows everything: its
        token is dropped).  Two preallocated buffers alternate, so filling step N+1's
        never overwrites what step N's sampling may still read."""
        if not self._bitmasks:
            words = (self.vocab_size + 31) // 32
            self._bitmasks = [torch.full((self.max_num_seqs, words), -1, dtype=torch.int32) for _ in range(2)]
        self._turn ^= 1
        bitmask = self._bitmasks[self._turn]
        matched: list[tuple[GrammarMatcher, int]] = []
        for req_id, row in rows.items():
            grammar = grammars.get(req_id)
            if grammar is None or not grammar.constraining():
                # Ended (its token is dropped anyway; overlap: it ended a step late), or not
                # constrained yet (reasoning before its structured answer).
                bitmask[row].fill_(-1)
            else:
                matched.append((grammar.matcher, row))
        if matched:
            self._get_backend().fill_bitmask(bitmask, matched)
        return GrammarBitmask(rows=list(rows.values()), bitmask=bitmask, vocab_size=self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
