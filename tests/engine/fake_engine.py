"""A deterministic stand-in for LLMEngine (same public surface the async layer uses),
so AsyncLLM and the HTTP layer can be tested in-process in milliseconds.

Tokens are characters (id = code point); request r emits the characters of `script`
in a cycle, one per step, then finishes with "length" at max_tokens.
"""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pagedserve.core.request import prompt_length_error
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.request_limits import MAX_PROMPT_CHARS
from pagedserve.sampling_params import SamplingParams


class CharTokenizer:
    eos_token_id = 0

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(ord(c), 255) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    unk_token_id = None

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """A one-character token's id; None for longer ones (no such token here)."""
        return min(ord(token), 255) if len(token) == 1 else None


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_stored_blocks: int = 0
    kv_offload_invalid_blocks: int = 0
    num_structured_requests: int = 0
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0


class FakeGrammars:
    """Grammar compilation as the fake sees it: done at once; its output follows no grammar."""

    def compile(self, params: object) -> Future:
        done: Future = Future()
        done.set_result(None)
        return done


@dataclass
class FakeProcessedRequest:
    """What the fake's InputProcessor hands the engine thread (the real one: EngineCoreRequest)."""

    request_id: str
    prompt: object
    sampling_params: object
    priority: int
    lora_request: object
    grammar: Future | None = None
    prompt_token_ids: list = field(default_factory=list)  # (what the fake's tokenizer makes of the prompt)
    arrival_time: float | None = None

    @property
    def pooling_params(self) -> object:
        return None if isinstance(self.sampling_params, SamplingParams) else self.sampling_params

    @property
    def num_sequences(self) -> int:
        return self.sampling_params.n if isinstance(self.sampling_params, SamplingParams) else 1


class FakeInputProcessor:
    """Intake as the fake does it: bad words tokenized (where it runs is recorded), the
    grammar compiled; every other check is the fake engine's own, on the engine thread."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def process(self, request_id, prompt, params, arrival_time=None, priority=0, lora_request=None):
        grammar = None
        if isinstance(params, SamplingParams):
            if params.structured_outputs is not None:
                grammar = self.engine.structured_output.compile(params.structured_outputs)
            if params.bad_words and not params.bad_words_token_ids:
                params = copy.copy(params)
                params.bad_words_token_ids = self.engine.bad_words_token_ids(params.bad_words)
        return FakeProcessedRequest(request_id, prompt, params, priority, lora_request, grammar,
                                    self.engine.prompt_ids(prompt), arrival_time)


class FakeEngine:
    vocab_size = 256
    invariant_checks = 0
    health_error: BaseException | None = None  # what check_health raises (a worker died while idle)
    device = torch.device("cpu")
    structured_outputs_backend = "guidance"
    runner = "generate"
    classifier_token_ids = None
    max_logprobs = 20
    stop_token_ids = [0]  # (the character tokenizer's EOS)

    def __init__(self, script: str = "abcdefghij", step_time: float = 0.0, busy: bool = False,
                 fail_after_steps: int | None = None, max_model_len: int = 4096,
                 spin_until: threading.Event | None = None, max_running: int | None = None) -> None:
        self.tokenizer = CharTokenizer()
        self.structured_output = FakeGrammars()
        self.input_processor = FakeInputProcessor(self)
        self.max_model_len = max_model_len
        self.max_prompt_chars = MAX_PROMPT_CHARS
        self.chat_template: str | None = "(characters)"  # encode_chat below renders chats without it
        self.script = script
        self.step_time = step_time
        self.busy = busy  # burn the CPU in Python (holding the GIL) instead of sleeping
        # Each step spins in Python until this is set (by another thread), then clears it.
        self.spin_until = spin_until
        self.fail_after_steps = fail_after_steps
        self.max_running = max_running  # requests past the first max_running wait (no tokens) like a full batch
        self.reqs: dict[str, tuple[list[int], SamplingParams, list[list[int]]]] = {}
        self.steps = 0
        self.shut_down = False
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.bad_words_threads: set[int] = set()  # where bad words were tokenized
        self.params_seen: list[SamplingParams] = []
        self.arrivals: dict[str, float | None] = {}  # each request's arrival_time, as the engine got it
        self.logprobs: dict[str, int | None] = {}  # each request's `logprobs` (the top-k asked for)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        self.bad_words_threads.add(threading.get_ident())
        return [self.tokenizer.encode(w) for w in words]

    def add_processed_request(self, request: FakeProcessedRequest) -> None:
        self.add_request(request.request_id, request.prompt, request.sampling_params, request.arrival_time,
                         priority=request.priority, lora_request=request.lora_request)

    def prompt_ids(self, prompt) -> list:
        if isinstance(prompt, dict):
            return prompt["prompt_token_ids"]
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0, lora_request=None):
        if lora_request is not None:
            raise ValueError("the fake engine has no LoRA adapters")
        self.thread_ids.add(threading.get_ident())
        self.params_seen.append(params)
        self.arrivals[request_id] = arrival_time
        ids = self.prompt_ids(prompt)
        # The engine's own checks, in its words.
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary", param="prompt")
        if (error := prompt_length_error(len(ids), self.max_model_len)) is not None:
            raise error
        if request_id in self.reqs:
            raise ValueError(f"duplicate request id {request_id}")
        max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - len(ids))
        self.reqs[request_id] = (ids, max_tokens, [[] for _ in range(params.n)])
        self.logprobs[request_id] = params.logprobs

    def abort_request(self, ids):
        self.thread_ids.add(threading.get_ident())
        for rid in ids:
            if self.reqs.pop(rid, None) is not None:
                self.aborted.append(rid)

    def check_invariants(self) -> None:
        self.invariant_checks += 1

    def check_health(self) -> None:
        if self.health_error is not None:
            raise self.health_error

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.reqs)

    def get_stats(self) -> FakeStats:
        running = len(self.reqs) if self.max_running is None else min(len(self.reqs), self.max_running)
        return FakeStats(num_running=running, num_waiting=len(self.reqs) - running, kv_cache_usage=0.01 * running)

    def get_num_waiting(self) -> int:
        return self.get_stats().num_waiting

    def sampling_defaults(self) -> dict:
        return {}

    def shutdown(self) -> None:
        self.shut_down = True

    def encode_chat(self, messages, chat_template=None, add_generation_prompt=True, **kwargs) -> dict:
        from pagedserve.engine.chat_utils import take_images
        from pagedserve.errors import ImageInputError

        if take_images(messages)[1]:  # as a text model's InputProcessor answers
            raise ImageInputError("this model takes no images: it is a text model", param="messages")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)}

    def top_logprobs(self, toks: list[int], k: int | None) -> list[dict[int, Logprob]] | None:
        """Where asked for: per token, it (rank 1) and the k - 1 code points after it, each
        a nat less likely."""
        if k is None:
            return None
        return [{t + j: Logprob(-1.0 - j, rank=j + 1) for j in range(max(k, 1))} for t in toks]

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.fail_after_steps is not None and self.steps > self.fail_after_steps:
            raise RuntimeError("simulated device failure")
        if self.spin_until is not None:
            deadline = time.monotonic() + 20
            while not self.spin_until.is_set():  # pure Python: the GIL is only given up by force
                if time.monotonic() > deadline:
                    raise RuntimeError("the event loop never ran while a step held the GIL")
            self.spin_until.clear()
        if self.busy:
            end = time.perf_counter() + self.step_time
            while time.perf_counter() < end:
                pass
        elif self.step_time:
            time.sleep(self.step_time)
        outputs = []
        for rid, (prompt, max_tokens, seqs) in list(self.reqs.items())[:self.max_running]:
            comps = []
            for i, toks in enumerate(seqs):
                if len(toks) < max_tokens:
                    toks.append(ord(self.script[(len(toks) + i) % len(self.script)]))
                done = len(toks) >= max_tokens
                comps.append(CompletionOutput(index=i, text=self.tokenizer.decode(toks), token_ids=list(toks),
                                              finish_reason="length" if done else None,
                                              logprobs=self.top_logprobs(toks, self.logprobs[rid])))
            finished = all(c.finish_reason for c in comps)
            outputs.append(RequestOutput(rid, None, prompt, comps, finished))
            if finished:
                del self.reqs[rid]
        return outputs
