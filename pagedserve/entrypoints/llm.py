"""The offline API: `LLM(model, **engine_args).generate(prompts, params)`.

Prompts are normalised here and handed to an `EngineCoreClient`'s `run_batch`: one
engine in this process (`InprocClient`: `LLMEngine.run_batch`, the batch loop), or with
data_parallel_size > 1 engine replicas on Ray that split every batch (`RayDPClient`).
`make_engine_core_client` chooses, as it does for the server.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.engine.arg_utils import DEFAULT_MODEL, EngineArgs, read_chat_template
from pagedserve.engine.async_llm import make_engine_core_client
from pagedserve.engine.beam_search import BeamSet, step_params, step_prompt
from pagedserve.engine.core import EngineStats
from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.engine.inproc_client import InprocClient
from pagedserve.engine.llm_engine import LLMEngine, naming_prompt
from pagedserve.engine.profiler import Profiler, profiler_dir
from pagedserve.entrypoints.score_utils import cosine, encode_reranker_pair, score_pairs
from pagedserve.lora.request import LoRARequest
from pagedserve.model_loader.tokenizer_snapshot import hf_tokenizer
from pagedserve.multimodal.inputs import MultiModalPrompt
from pagedserve.outputs import (
    BeamSearchOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedserve.pooling_params import POOLING_TASKS, PoolingParams
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | list[int] | dict[str, Any]
Conversation = list[dict[str, Any]]


class LLM:
    """An engine client plus the batch API.  Keyword arguments are EngineArgs fields
    (dtype, max_model_len, enable_prefix_caching, kv_cache_memory_bytes, ...);
    data_parallel_size=N runs N engine replicas on Ray and splits each batch over them
    (`llm_engine`, the engine in this process, is then None)."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        # No step-time target unless asked: it keeps a server's streams flowing beside long
        # prompts, and an offline batch has no stream to keep (its schedule then depends
        # on the token budget alone, not on measured step times).
        engine_args.setdefault("max_step_ms", 0)
        self.profiler = Profiler(profiler_dir(engine_args.pop("profiler_config", None)))
        args = EngineArgs.from_kwargs("LLM()", model=model, **engine_args)
        self.client: EngineCoreClient = make_engine_core_client(args, own_thread=False)
        self.llm_engine: LLMEngine | None = self.client.local_engine

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an already built engine (tests, custom runners)."""
        llm = cls.__new__(cls)
        llm.client = InprocClient(engine)
        llm.llm_engine = engine
        llm.profiler = Profiler(profiler_dir())
        return llm

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start recording a torch profile of the engine (vLLM's; engine/profiler.py):
        on only with profiler_config={"profiler": "torch", "torch_profiler_dir": DIR}
        or $VLLM_TORCH_PROFILER_DIR.  Data-parallel replicas run in other processes."""
        if self.llm_engine is None:
            raise RuntimeError("profiling records this process's engine; data-parallel replicas run in others")
        self.profiler.start(profile_prefix)

    def stop_profile(self) -> str:
        """End the profile; the path of its Chrome trace."""
        return self.profiler.stop()

    def get_tokenizer(self) -> Any:
        """transformers' tokenizer of the model (the engine may hold a snapshot of it)."""
        return hf_tokenizer(self.client.info.tokenizer)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block no request holds (vLLM's LLM.reset_prefix_cache),
        in every data-parallel replica too; False where a running request holds some."""
        return self.client.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate()` uses when given no SamplingParams: the model's generation-config
        defaults (--generation-config auto), else the built-in ones."""
        return SamplingParams(**self.client.info.sampling_defaults)

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes and data-parallel replicas now (otherwise:
        when garbage collected or at exit)."""
        self.client.shutdown()

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Prompts: a string, a list of token ids, {"prompt_token_ids": [...]} /
        {"prompt": "..."} dicts, or a list of these.  sampling_params: one for all
        prompts or a list with one per prompt.  priority (one per prompt) matters only
        with scheduling_policy="priority".  lora_request (enable_lora=True): one adapter
        for every prompt, or one per prompt (None: the base model).  Outputs come back
        in input order."""
        prompt_list = _normalize_prompts(prompts)
        if priority is not None and not isinstance(priority, (list, tuple)):
            raise TypeError(f"priority must be a list with one integer per prompt, got {type(priority).__name__}")
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._run(prompt_list, _normalize_params(sampling_params, len(prompt_list)), use_tqdm, priority,
                         lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered with the model's chat template (or `chat_template`: Jinja text, or a file
        holding it, rendered as the server renders a request's own, in a bounded child
        process), as the server renders them: `tools` (OpenAI function definitions) and
        `chat_template_kwargs` reach the template, `continue_final_message` continues the
        last message (any role's, as HF renders it).  `chat_template_content_format`
        (vLLM's): "auto" alone, as the renderer gives content parts to a template the way it
        reads them.  The
        arguments come in vLLM's order (a script's positional call binds as it did there:
        a template given fourth was taken as add_generation_prompt)."""
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("continue_final_message", continue_final_message)):
            if not isinstance(value, bool):  # ("no" was true)
                raise TypeError(f"{name} must be True or False, got {value!r:.40}")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be Jinja text or a file name, got {type(chat_template).__name__}")
        if chat_template_content_format != "auto":
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r:.40} is not supported "
                             "here: content parts reach each template the way it reads them (vLLM's 'auto')")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation (list of dicts) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        chat_template = read_chat_template(chat_template)  # the caller's own process may name a file
        client = self.client
        kwargs = dict(chat_template_kwargs=chat_template_kwargs, continue_final_message=continue_final_message)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _normalize_params(sampling_params, len(conversations))
        def render(conv: Sequence[dict], p: SamplingParams, **changed: Any) -> dict[str, Any]:
            return client.encode_chat(list(conv), chat_template, add_generation_prompt,
                                      **{"tools": tools, **kwargs, **changed}, cut=p.truncate_prompt_tokens is not None)

        prompts = [render(conv, p) for conv, p in zip(conversations, params, strict=True)]
        # What the template does not write, the model would never see: refused by name.
        # (Compared as text: the ids may be a cut's.  The server writes past calls into the
        # turn's text in its tool parser's format; here is no parser.)
        if tools and render(conversations[0], params[0], tools=None)["prompt"] == prompts[0]["prompt"]:
            raise ValueError("tools: this chat template does not render tools, so the model would never see them "
                             "(give a chat_template that renders `tools`, or describe them in a system message)")
        for conv, prompt, p in zip(conversations, prompts, params, strict=True):
            without = [{k: v for k, v in m.items() if k != "tool_calls"} if isinstance(m, dict) else m for m in conv]
            if without != list(conv) and render(without, p)["prompt"] == prompt["prompt"]:
                raise ValueError("tool_calls: this chat template does not render an assistant turn's tool calls, "
                                 "so the model would never see them (give a chat_template that renders "
                                 "`tool_calls`, or write the calls into the turn's content)")
        return self._run(prompts, params, use_tqdm, None, lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool | Callable[..., Any] = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """The `params.beam_width` best continuations of each prompt (vLLM's API), as HF
        transformers' `num_beams` search finds them: each step every live beam of every
        prompt asks the engine, in one batch, for its 2 x beam_width most likely next
        tokens (one-token requests whose prompts share their blocks through the prefix
        cache); the beam_width best extensions by cumulative logprob live on, and an EOS
        among them finishes its beam.  vLLM's other arguments: `lora_request` (one, or
        one per prompt), `use_tqdm` (a bar over the steps; a tqdm class is used as it),
        `concurrency_limit` (at most that many prompts searched at once)."""
        engine = self.llm_engine
        if engine is None:
            raise ValueError("beam search runs on one engine (data_parallel_size=1)")
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        params.validate(engine.model_config.max_logprobs)
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int)
                                              or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer or None, got {concurrency_limit!r}")
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise TypeError(f"use_tqdm must be true, false or a tqdm class, got {type(use_tqdm).__name__}")
        prompt_list = _normalize_prompts(prompts)
        loras = _normalize_loras(lora_request, len(prompt_list)) or [None] * len(prompt_list)
        chunk = concurrency_limit or max(len(prompt_list), 1)
        bar = _ProgressBar(None, params.max_tokens * -(-len(prompt_list) // chunk), use_tqdm if callable(use_tqdm)
                           else None, desc="Beam search", unit="step") if use_tqdm and prompt_list else None
        try:
            out: list[BeamSearchOutput] = []
            for i in range(0, len(prompt_list), chunk):
                out += self._beam_search(prompt_list[i:i + chunk], loras[i:i + chunk], params, bar)
            return out
        finally:
            if bar is not None:
                bar.close()

    def _beam_search(self, prompt_list: list[Prompt], loras: list[LoRARequest | None], params: BeamSearchParams,
                     bar: _ProgressBar | None) -> list[BeamSearchOutput]:
        engine = self.llm_engine
        assert engine is not None
        step = step_params(params.beam_width)
        # Each step's beams carry the prompt's cache salt and images: expanded once, here.
        salts: list[str | None] = [None] * len(prompt_list)
        images: list[MultiModalPrompt | None] = [None] * len(prompt_list)
        for i, p in enumerate(prompt_list):
            if isinstance(p, dict):
                salts[i] = p.get("cache_salt")
                with naming_prompt(i if len(prompt_list) > 1 else -1):
                    images[i] = engine.input_processor.prompt_images(p)
                if images[i] is not None:
                    prompt_list[i] = {**p, "multi_modal": images[i]}
        first = self._run(prompt_list, [step] * len(prompt_list), use_tqdm=False, lora_request=loras)
        stops = set() if params.ignore_eos else set(engine.stop_token_ids)
        # (a search whose beams fill the context ends there, "length" as generate's sequences
        # do: asking for one more token past it failed the whole call)
        searches = [BeamSet(list(out.prompt_token_ids), [out.outputs[0].logprobs[0]], params, stops,
                            engine.max_model_len - len(out.prompt_token_ids)) for out in first]
        steps_run = 0
        for n in range(params.max_tokens):
            todo = [(b, lora, salt, mm) for b, lora, salt, mm in zip(searches, loras, salts, images, strict=True)
                    if b.live]
            if not todo:
                break
            if n:
                asks = [(step_prompt(ids, salt, mm), lora) for b, lora, salt, mm in todo for ids in b.asks()]
                outs = iter(self._run([a for a, _ in asks], [step] * len(asks), use_tqdm=False,
                                      lora_request=[lora for _, lora in asks]))
                for b, *_ in todo:
                    b.tops = [next(outs).outputs[0].logprobs[0] for _ in b.live]
            for b, *_ in todo:
                b.extend()
            if bar is not None:
                bar.advance()
                steps_run = n + 1
        if bar is not None and steps_run < params.max_tokens:  # (every beam ended early: the bar completes)
            bar.advance(params.max_tokens - steps_run)
        tokenizer = engine.tokenizer
        decode = tokenizer.decode if tokenizer is not None else None
        return [BeamSearchOutput(b.sequences(decode)) for b in searches]

    def __getattr__(self, name: str) -> Any:
        """vLLM's LLM methods this engine does not have, named with the reason (they were a
        bare AttributeError)."""
        why = _NOT_HERE.get(name)
        if why is None:
            raise AttributeError(f"'LLM' object has no attribute {name!r}")
        raise AttributeError(f"LLM.{name} (vLLM's) is not supported here: {why}")

    # ------------------------------------------------------------------ pooling
    def encode(self, prompts: Prompt | Sequence[Prompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool | Callable[..., Any] = True, truncate_prompt_tokens: int | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """With runner="pooling": one pooled result per prompt (vLLM's `encode`), each a
        prefill through the same scheduler, block pool and prefix cache as generation.
        `truncate_prompt_tokens` (vLLM's): each prompt's last N tokens (-1: max_model_len);
        `pooling_task` (vLLM's): "embed" or "classify", every PoolingParams' task."""
        prompt_list = _normalize_prompts(prompts)
        params = _normalize_params(pooling_params or PoolingParams(), len(prompt_list), PoolingParams)
        if pooling_task is not None:
            if pooling_task not in POOLING_TASKS:
                raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {pooling_task!r:.40}")
            params = [dataclasses.replace(p, task=pooling_task) for p in params]
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self._run(prompt_list, params, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool | Callable[..., Any] = True, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """With runner="pooling": each prompt's embedding (`.outputs.embedding`), pooled as
        the engine's pooler_config says (the last token's state, L2-normalised, unless
        it says otherwise)."""
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool | Callable[..., Any] = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """With runner="pooling" and classifier tokens in the pooler_config (a reranker):
        each prompt's probability of the positive token (`.outputs.probs`, one class, as
        vLLM's single-label classifier gives it)."""
        outs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: str | list[int] | Sequence[str | list[int]], data_2: str | list[int] | Sequence[str | list[int]],
              use_tqdm: bool | Callable[..., Any] = True, instruction: str | None = None) -> list[ScoringRequestOutput]:
        """With runner="pooling": the relevance of each (data_1, data_2) pair (one data_1
        against every data_2, or two lists pairwise).  With classifier tokens in the
        pooler_config the pair is one reranker prompt (`instruction`: its task line) and
        the score is P(positive token); otherwise the cosine of the two embeddings."""
        engine = self.llm_engine
        if engine is None:
            raise ValueError("score runs on one engine (data_parallel_size=1)")
        pairs = score_pairs(list(data_1) if isinstance(data_1, tuple) else data_1,
                            list(data_2) if isinstance(data_2, tuple) else data_2, ("data_1", "data_2"))
        if engine.classifier_token_ids is not None:
            if not all(isinstance(a, str) and isinstance(b, str) for a, b in pairs):
                raise ValueError("a reranker scores text: data_1 and data_2 must be strings")
            encoded = [encode_reranker_pair(engine.tokenizer, a, b, instruction, engine.max_prompt_chars, "data_2")
                       for a, b in pairs]
            outs = self.encode([{"prompt": text, "prompt_token_ids": ids} for text, ids in encoded],
                               PoolingParams(task="classify"), use_tqdm)
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(float(o.outputs.data[0])))
                    for o in outs]
        if instruction is not None:
            raise ValueError("instruction is the reranker's (pooler_config classifier_from_token); embedding "
                             "similarity takes none")
        outs = self.encode([t for pair in pairs for t in pair], PoolingParams(task="embed"), use_tqdm)
        return [ScoringRequestOutput(b.request_id, a.prompt_token_ids + b.prompt_token_ids,  # (vLLM's: both texts')
                                     ScoringOutput(cosine(a.outputs.data, b.outputs.data)))
                for a, b in zip(outs[::2], outs[1::2], strict=True)]

    def _run(self, prompts: list[Prompt], params: list[SamplingParams] | list[PoolingParams], use_tqdm: bool | Callable[..., Any],
             priority: Sequence[int] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> Any:
        client = self.client
        loras = _normalize_loras(lora_request, len(prompts))
        stats = self.llm_engine.get_stats if self.llm_engine is not None else None
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise TypeError(f"use_tqdm must be true, false or a tqdm class, got {type(use_tqdm).__name__}")
        bar = _ProgressBar(stats, len(prompts), use_tqdm if callable(use_tqdm) else None) if use_tqdm and prompts \
            else None
        try:
            return client.run_batch(prompts, params, list(priority) if priority is not None else None, bar, loras)
        finally:
            if bar is not None:
                bar.close()


# vLLM's LLM methods not served here, and why (LLM.__getattr__ names them).
_NOT_HERE = {
    "sleep": "there is no sleep mode; shutdown() frees the engine",
    "wake_up": "there is no sleep mode; shutdown() frees the engine",
    "collective_rpc": "workers take no arbitrary calls; llm.llm_engine is the engine in this process",
    "apply_model": "the model runs only through the engine; llm.llm_engine is in this process",
    "get_metrics": "the engine's figures are the server's /metrics (pagedserve serve)",
    "set_tokenizer": "the tokenizer comes with the model (tokenizer=... when the LLM is made)",
    "reward": "reward models are not served; encode(), embed(), classify() and score() are",
}


# What writing to a stderr that cannot be written raises: closed (ValueError), None
# (AttributeError), fd 2 closed or a pipe whose reader left (OSError, BrokenPipeError).
_UNWRITABLE = (OSError, ValueError, AttributeError)


class _ProgressBar:
    """tqdm over requests, with input and output tokens/s measured from the engine's
    counters (`stats`; None for data-parallel replicas, whose counters stay with them).
    A bar that cannot write its stream turns itself off: the batch goes on, and its
    finished work is not lost (a broken pipe threw a whole batch's outputs away)."""

    def __init__(self, stats: Callable[[], EngineStats] | None, total: int, bar_class: Any = None,
                 desc: str = "Processed prompts", unit: str = "it") -> None:
        """`bar_class`: a caller's tqdm (vLLM's use_tqdm may be one), else tqdm.auto's;
        `desc` and `unit`: what it counts (requests; beam search's steps)."""
        from tqdm.auto import tqdm

        tqdm = bar_class or tqdm
        self.stats = stats
        first = stats() if stats is not None else None
        self.base = (first.num_prompt_tokens, first.num_generation_tokens) if first is not None else (0, 0)
        self.start = time.perf_counter()
        self.last = 0.0
        try:
            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True,
                            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s" if stats else None)
        except _UNWRITABLE:
            self.bar = None

    def _write(self, draw: Callable[[Any], Any]) -> None:
        if self.bar is None:
            return
        try:
            draw(self.bar)
        except _UNWRITABLE:
            self.bar = None

    def advance(self, n: int = 1) -> None:
        self._write(lambda bar: bar.update(n))

    def finished_one(self) -> None:
        self.advance()

    def tick(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.bar is None or not force and now - self.last < 0.25:
            return
        self.last = now
        if self.stats is None:
            self._write(lambda bar: bar.refresh())
            return
        stats = self.stats()
        elapsed = max(now - self.start, 1e-9)
        tin = (stats.num_prompt_tokens - self.base[0]) / elapsed
        tout = (stats.num_generation_tokens - self.base[1]) / elapsed
        self._write(lambda bar: (bar.set_postfix_str(f"est. speed input: {tin:.2f} toks/s, output: {tout:.2f} toks/s",
                                                     refresh=False), bar.refresh()))

    def close(self) -> None:
        self.tick(force=True)
        self._write(lambda bar: bar.close())


def _normalize_prompts(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise ValueError(
        "prompts must be a string, a list of token ids, a prompt dict, or a list of these; "
        f"got {type(prompts).__name__}"
    )


def _normalize_loras(lora_request: Any, n: int) -> list[LoRARequest | None] | None:
    """One adapter for all n prompts, or one (or None) per prompt; None: the base model for all."""
    return None if lora_request is None else _per_prompt(lora_request, n, LoRARequest, "lora_request", optional=True)


def _normalize_params(params: Any, n: int, kind: type = SamplingParams) -> list[Any]:
    """One params object for all n prompts, or one per prompt, each a `kind`."""
    if params is None:
        return [kind()] * n
    return _per_prompt(params, n, kind, "sampling_params" if kind is SamplingParams else "pooling_params")


def _per_prompt(value: Any, n: int, kind: type, name: str, optional: bool = False) -> list[Any]:
    """`value` (a `kind`) for all n prompts, or a list of one per prompt (each a `kind`, or
    None where `optional`)."""
    if isinstance(value, kind):
        return [value] * n
    what = f"a {kind.__name__}" + (" or None" if optional else "")
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"got {len(value)} {name} for {n} prompts; pass one, or one per prompt")
        for i, item in enumerate(value):
            if not (isinstance(item, kind) or (optional and item is None)):
                raise ValueError(f"{name}[{i}] must be {what}, got {type(item).__name__}")
        return list(value)
    raise ValueError(f"{name} must be a {kind.__name__} or a list of them, got {type(value).__name__}")
