"""InputProcessor: what a caller sent, turned into a checked request the engine core takes.

vLLM v1's name and role.  Every check of a request that needs the model, the tokenizer
or the engine's limits happens here, once, and raises `InvalidRequestError` (a
`ValueError` whose `param` names the field) before the request reaches the scheduler:
a bad request never disturbs the others, and the core never sees bad input.
`SamplingParams` and `PoolingParams` check their own fields' types and ranges (their
`validate`); the rules here are the ones that need this engine:

- the prompt: a string, token ids or a prompt dict; ids inside the vocabulary; not
  empty; text no longer than `max_model_len` tokens could hold (refused untokenized);
- `logprobs`/`prompt_logprobs` against `max_logprobs`, `n` against `max_n`, stop /
  allowed / logit-bias token ids against the vocabulary, fields that need a tokenizer,
  a priority only under the priority policy;
- a predicted output (`prediction`): text within the prompt's character bound or ids
  inside the vocabulary and max_model_len, tokenized here once; refused under overlap
  scheduling, whose steps start before the tokens its drafts follow are known;
- per-request preparation: bad words tokenized, `n` fanned out into child parameters
  (distinct seeds, the model's extra EOS ids as stops), pooling parameters completed from
  the PoolerConfig, the grammar compiled (a future: a bad schema fails the request);
- a LoRA request's type and whether LoRA is enabled (loading the adapter's weights is
  the executor's, on the engine thread, between steps);
- images (`multi_modal_data`, or image parts of chat messages): only for a vision model,
  at most limit_mm_per_prompt, each loaded within the bounds of multimodal/image.py, then
  the family's processor expands the prompt's placeholders (multimodal/<family>.py); an
  image whose span could never run in one step when it may not be split is refused.

What the prompt's length allows against `max_model_len` and the KV cache is the
scheduler's to check (it owns those limits), and whether a request id is in use is the
engine's (it owns the open requests).

It holds no per-request state, so it runs on whatever thread the front end chooses: the
server calls it in a worker thread (neither the event loop nor the engine thread waits
on tokenizing), the offline engine in its caller's.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.engine.chat_utils import (
    encode_rendered,
    encode_text,
    hide_client_text,
    prompt_char_limit,
    render_chat,
    take_images,
)
from pagedserve.engine.special_text import special_token_ids
from pagedserve.errors import ImageInputError, InvalidRequestError, text_model_image_error
from pagedserve.lora.request import LoRARequest
from pagedserve.model_loader.tokenizer_snapshot import longest_token_chars
from pagedserve.multimodal.image import DECODING, MediaPolicy, decode, open_image, upright_size
from pagedserve.multimodal.inputs import ImageFeature, ImagePromptProcessor, MultiModalPrompt
from pagedserve.pooling_params import PoolingParams
from pagedserve.reasoning import END, START, answer_starts_inside
from pagedserve.request_limits import MAX_CACHE_SALT_CHARS
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output import StructuredOutputManager
from pagedserve.utils import is_int
from pagedserve.worker.cpu_malloc import note_freed_memory

# The keys a prompt dict may carry (vLLM's names; "multi_modal" is a prompt whose images
# this processor has already expanded, as encode_chat returns it).
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data", "multi_modal"})


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None
    images: list[ImageFeature] | None = None
    mrope: tuple[Any, int] | None = None  # (positions [3, len], delta) of an M-RoPE model


@dataclass
class EngineCoreRequest:
    """A request as the engine core takes it: every field checked, every per-request
    preparation done.  `child_ids`/`child_params` are the scheduler's sequences (one, or
    `n` for n > 1); `grammar` is the compiling grammar of a structured-output request;
    `prediction_token_ids` its predicted output's tokens, the request's own drafts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None
    sampling_params: SamplingParams
    child_ids: list[str]
    child_params: list[SamplingParams]
    pooling_params: PoolingParams | None
    arrival_time: float
    priority: int
    lora_request: LoRARequest | None
    grammar: Future | None
    prediction_token_ids: list[int] | None = None
    images: list[ImageFeature] | None = None  # the prompt's images, spans in position order
    mrope: tuple[Any, int] | None = None  # an M-RoPE model's (positions, delta)

    @property
    def num_sequences(self) -> int:
        return len(self.child_ids)


class InputProcessor:
    """Intake for one model: tokenizer, chat templates, limits, per-request preparation."""

    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int, extra_eos_token_ids: list[int],
                 structured_output: StructuredOutputManager,
                 classifier_token_ids: tuple[int, int] | None = None,
                 image_prompts: ImagePromptProcessor | None = None) -> None:
        """`structured_output` is shared with the engine core: this side compiles grammars,
        the core's matchers fill the step's bitmask.  `image_prompts`: a vision model's
        prompt processor (None: the model takes no images)."""
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.extra_eos_token_ids = list(extra_eos_token_ids)
        self.structured_output = structured_output
        self.classifier_token_ids = classifier_token_ids
        # Longer prompt text cannot fit in max_model_len tokens: refused before tokenizing.
        self.max_prompt_chars = prompt_char_limit(None if tokenizer is None else longest_token_chars(tokenizer),
                                                  config.scheduler_config.max_model_len)
        self.image_prompts = image_prompts
        domains = self.model_config.allowed_media_domains
        self.media_policy = MediaPolicy(tuple(domains) if domains else None)
        self.max_images = self.model_config.limit_mm_per_prompt.get("image", 0)

    # ------------------------------------------------------------------ the request
    def process(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams | None = None,
                arrival_time: float | None = None, priority: int = 0,
                lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        """Check and prepare one request.  `params`: SamplingParams (generate runner) or
        PoolingParams (pooling runner; the scheduler then runs one sequence that samples
        nothing).  Raises ValueError naming the problem; the caller's objects are never
        modified (one params object may serve many prompts)."""
        if arrival_time is None:  # (before the work below, as vLLM's: it orders equal priorities)
            arrival_time = time.time()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        sampling, pooling = self._split_params(params)
        sampling.validate()  # values may have been changed after construction
        if not is_int(priority):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", param="priority")
        truncate = (pooling or sampling).truncate_prompt_tokens
        processed = self.process_prompt(prompt, cut=truncate is not None)
        if not processed.images:
            self.check_no_image_tokens(processed.token_ids)
        prompt_ids = self.truncate_prompt(processed.token_ids, truncate, self.config.scheduler_config.max_model_len,
                                          processed.images is not None, 0 if pooling else sampling.max_tokens or 1)
        if prompt_ids is not processed.token_ids:  # a cut prompt keeps the caller's text (vLLM's RequestOutput.prompt)
            processed = dataclasses.replace(processed, token_ids=prompt_ids)
        self.check_request(prompt_ids, sampling, priority)
        if lora_request is not None:
            self.check_lora(lora_request)
        prediction_ids = self.prediction_token_ids(sampling.prediction)
        grammar = None
        if sampling.structured_outputs is not None:
            grammar = self.structured_output.claim(sampling.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()
        if sampling.bad_words and not sampling.bad_words_token_ids:  # once per request, not per sample
            sampling = copy.copy(sampling)
            sampling.bad_words_token_ids = self.bad_words_token_ids(sampling.bad_words)
        if sampling.thinking_token_budget is not None:  # (per prompt: where its answer starts)
            sampling = copy.copy(sampling)
            sampling.thinking_tags = self.thinking_tags(prompt_ids, sampling)
        n = sampling.n
        child_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        return EngineCoreRequest(
            request_id, processed.text, prompt_ids, processed.cache_salt, sampling, child_ids,
            [self.child_params(sampling, i) for i in range(n)], pooling,
            arrival_time, priority, lora_request, grammar, prediction_ids,
            processed.images, processed.mrope)

    @staticmethod
    def truncate_prompt(token_ids: list[int], truncate: int | None, max_model_len: int, has_images: bool,
                        room: int = 0) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `truncate` tokens (-1: as many
        as fit with `room` tokens to generate, at least one: a prompt cut to max_model_len,
        vLLM's -1, was then refused for leaving none; None: all of it).  Refused past
        max_model_len, and where it would cut a prompt with images (their spans would be
        cut).  The one rule: the offline params' field and the server's request field both
        come here."""
        if truncate is None:
            return token_ids
        if truncate == -1:
            truncate = max(1, max_model_len - room)
        if not is_int(truncate) or not 1 <= truncate <= max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or within 1..max_model_len ({max_model_len}), "
                                      f"got {truncate!r:.100}", param="truncate_prompt_tokens")
        if len(token_ids) <= truncate:
            return token_ids
        if has_images:
            raise InvalidRequestError("truncate_prompt_tokens cannot cut a prompt with images (their spans would be cut)",
                                      param="truncate_prompt_tokens")
        return token_ids[-truncate:]

    def _split_params(self, params: SamplingParams | PoolingParams | None,
                      ) -> tuple[SamplingParams, PoolingParams | None]:
        """(what the scheduler runs, the pooling params if it is a pooling request)."""
        is_pooling_runner = self.model_config.runner == "pooling"
        if params is None:
            params = PoolingParams() if is_pooling_runner else SamplingParams()
        if isinstance(params, PoolingParams):
            # The scheduler's bookkeeping: one token's step; nothing is sampled.
            return SamplingParams(max_tokens=1), self.resolve_pooling(params)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams or a PoolingParams, got {type(params).__name__}")
        if is_pooling_runner:
            raise InvalidRequestError("this engine runs the pooling runner (runner='pooling'): it embeds and scores "
                                      "prompts; generating text needs runner='generate'", param="model")
        return params, None

    def process_prompt(self, prompt: Any, cut: bool = False) -> ProcessedPrompt:
        """Text, token ids, cache salt and images.  A dict prompt may carry vLLM's
        `cache_salt` (its blocks then never share the prefix cache with another salt's, or
        no salt's) and `multi_modal_data` ({"image": an image or a list of them}).  `cut`:
        only the prompt's last tokens will run (truncate_prompt_tokens; see encode)."""
        if isinstance(prompt, dict):
            return self._process_prompt_dict(prompt, cut)
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, self.encode(prompt, cut))
        if isinstance(prompt, (list, tuple)):
            return ProcessedPrompt(None, self.check_token_ids(prompt))
        raise InvalidRequestError(
            "a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
            f"'prompt_token_ids', got {type(prompt).__name__}", param="prompt")

    def _process_prompt_dict(self, prompt: dict[str, Any], cut: bool) -> ProcessedPrompt:
        unknown = set(prompt) - PROMPT_KEYS
        if unknown or not (set(prompt) & {"prompt", "prompt_token_ids"}):
            raise InvalidRequestError(
                "a prompt dict takes the keys 'prompt' and/or 'prompt_token_ids' (and 'cache_salt', "
                f"'multi_modal_data'), got {sorted(prompt)}", param="prompt")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError(f"'prompt' must be a string, got {type(text).__name__}", param="prompt")
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                      "characters", param="cache_salt")
        if (mm := self.prompt_images(prompt)) is not None:
            mrope = None if mm.mrope_positions is None else (mm.mrope_positions, mm.mrope_position_delta)
            return ProcessedPrompt(text, self.check_token_ids(mm.prompt_token_ids), salt, mm.images, mrope)
        ids = prompt.get("prompt_token_ids")
        return ProcessedPrompt(text, self.encode(text, cut) if ids is None else self.check_token_ids(ids), salt)

    # ------------------------------------------------------------------ images
    def prompt_images(self, prompt: dict[str, Any]) -> MultiModalPrompt | None:
        """A dict prompt's images expanded into its tokens (its `multi_modal_data`'s, or
        the expansion it carries as `multi_modal`); None for a prompt without images."""
        multi_modal = prompt.get("multi_modal")
        if multi_modal is None and prompt.get("multi_modal_data") is not None:
            text = prompt.get("prompt")
            if not isinstance(text, str):
                raise ImageInputError("multi_modal_data needs the prompt as text (with the model's image placeholder "
                                      "where each image goes), not only prompt_token_ids", param="multi_modal_data")
            multi_modal = self.expand_images(text, self.image_sources(prompt["multi_modal_data"]), self.encode,
                                             "multi_modal_data")
        if multi_modal is not None and not isinstance(multi_modal, MultiModalPrompt):
            raise InvalidRequestError("'multi_modal' is the engine's own expanded prompt (encode_chat's); "
                                      "send images as multi_modal_data", param="prompt")
        return multi_modal

    def image_sources(self, data: Any) -> list[Any]:
        """multi_modal_data's images (an image or a list of them)."""
        if not isinstance(data, dict) or set(data) - {"image"}:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ImageInputError(f"multi_modal_data takes {{'image': an image or a list of images}}, got {keys}",
                                      param="multi_modal_data")
        images = data.get("image")
        return list(images) if isinstance(images, (list, tuple)) else [images]

    def check_image_count(self, sources: list[Any]) -> None:
        """A prompt's images: refused by name for a model that takes none, or past
        limit_mm_per_prompt."""
        if self.image_prompts is None:
            raise text_model_image_error()
        if len(sources) > self.max_images:
            raise ImageInputError(f"the prompt has {len(sources)} images, more than the {self.max_images} "
                                      "limit_mm_per_prompt allows (--limit-mm-per-prompt)", param="messages")

    def expand_images(self, text: str, sources: list[Any], encode: Any, param: str = "messages") -> MultiModalPrompt:
        """The prompt's images (PIL images, bytes, URLs), at most limit_mm_per_prompt of
        them, each opened and checked (multimodal/image.py), then decoded once the
        process's pixel budget has room for them all, and the family's expansion of the
        prompt's placeholders (tokenized by `encode`); then the checks that need its
        result: the image spans must run (an unsplittable span within one step's tokens,
        each image's rows within the encoder cache).  Errors name `param`, the field
        that held the images."""
        self.check_image_count(sources)
        assert self.image_prompts is not None
        deadline = self.media_policy.fetch_deadline()  # (one for all of the prompt's URLs)
        opened = [open_image(source, self.media_policy, param, deadline) for source in sources]
        for image in opened:  # (an image that can never fit costs no decoding)
            try:
                rows = self.image_prompts.embeds_for_size(*upright_size(image))
            except ValueError as e:
                raise ImageInputError(f"the image is {image.width}x{image.height} pixels: {e}", param=param) from None
            self.check_encoder_rows(rows)
        try:
            with DECODING.hold(sum(image.width * image.height for image in opened)):
                images = [decode(image, param) for image in opened]
                del opened
                prompt = self.image_prompts.process(text, images, encode)
                del images
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise ImageInputError(str(e), param="messages") from None
        finally:
            # The decoded images' memory goes back to the kernel at the engine's next idle
            # pause: this thread's malloc arena keeps what is freed up to the raised trim
            # threshold (worker/cpu_malloc.py), and each prepare thread has its own (3.5 GB
            # held at rest after 16 prompts of 8 large images).  Not here: malloc_trim
            # trims every arena, the engine thread's too, mid-load.
            note_freed_memory()
        sched = self.config.scheduler_config
        for image in prompt.images:
            if sched.disable_chunked_mm_input and image.length > sched.max_num_batched_tokens:
                raise ImageInputError(f"an image takes {image.length} prompt positions, more than one step's "
                                          f"max_num_batched_tokens ({sched.max_num_batched_tokens}), and this model's "
                                          "images cannot be split across steps", param="messages")
            self.check_encoder_rows(image.num_embeds)
        return prompt

    def check_encoder_rows(self, rows: int) -> None:
        """An image's encoder rows must fit in the encoder cache (all of them run at once)."""
        room = self.config.scheduler_config.encoder_cache_rows
        if rows > room:
            raise ImageInputError(f"an image takes {rows} encoder rows, more than the encoder cache holds ({room}: "
                                  "encoder_cache_size)", param="messages")

    def check_no_image_tokens(self, token_ids: list[int]) -> None:
        """A prompt without images must not hold the token that takes an image's rows (the
        model would read a placeholder's embedding as an image): refused as a prompt with
        images is where its count is wrong."""
        if self.image_prompts is not None and self.image_prompts.image_token_id in token_ids:
            raise ImageInputError(f"the prompt holds the image token (id {self.image_prompts.image_token_id}, "
                                  f"part of the expansion of {self.image_prompts.placeholder!r}) but has no image: image tokens "
                                  "come only from images", param="prompt")

    def encode(self, text: str, cut: bool = False) -> list[int]:
        """Prompt text to token ids (refused untokenized when it cannot fit, unless it is to
        be `cut` to its last tokens: chat_utils.encode_text)."""
        if not text:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer (e.g. load_format='dummy' without tokenizer files): "
                "pass token ids instead, e.g. {'prompt_token_ids': [1, 2, 3]}", param="prompt")
        ids = encode_text(self.tokenizer, text, self.max_prompt_chars, cut=cut)
        if ids and max(ids) >= self.vocab_size:  # (a tokenizer with more tokens than the weights: a crash in a step)
            raise InvalidRequestError(f"the prompt's text tokenizes to id {max(ids)}, outside the model's vocabulary "
                                      f"(0..{self.vocab_size - 1}): its tokenizer has tokens its weights lack",
                                      param="prompt")
        return ids

    def check_token_ids(self, ids: Any) -> list[int]:
        """A prompt's token ids as plain ints, each inside the vocabulary."""
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}",
                                      param="prompt")
        ids = list(ids)
        vocab = self.vocab_size
        for pos, t in enumerate(ids):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool):
                raise InvalidRequestError(f"prompt_token_ids[{pos}] is {t!r}, not an integer", param="prompt")
            if type(t) is not int:  # numpy integers: plain ints from here on
                ids[pos] = t = int(t)
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t} at position {pos} of the prompt is outside the "
                                          f"vocabulary (0..{vocab - 1})", param="prompt")
        return ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams, priority: int) -> None:
        """Every engine limit a request can break, each raised as InvalidRequestError
        naming the field."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        # (a top-k past the vocabulary failed in the runner's topk, and took the engine down)
        limit, why = min((self.model_config.max_logprobs, "max_logprobs"), (self.vocab_size, "the model's vocabulary"))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise InvalidRequestError(f"{name} must be at most {limit} ({why}), got {value}", param=name)
        sched = self.config.scheduler_config
        room = sched.max_model_len - len(prompt_ids)
        if 1 <= room < params.min_tokens:  # (max_tokens unset: "the rest of the context", then unmet)
            raise InvalidRequestError(f"min_tokens must be at most the {room} tokens max_model_len "
                                      f"({sched.max_model_len}) leaves after the prompt's {len(prompt_ids)}, "
                                      f"got {params.min_tokens}", param="min_tokens")
        if params.n > sched.max_n:
            raise InvalidRequestError(f"n must be at most {sched.max_n} (max_n), got {params.n}", param="n")
        self._check_vocabulary_ids(params)
        self._check_tokenizer_fields(params)
        if priority != 0 and sched.policy != "priority":
            # vLLM's wording, so clients written against vLLM recognise it.
            raise InvalidRequestError(f"Got priority {priority} but Priority scheduling is not enabled.",
                                      param="priority")

    def _check_vocabulary_ids(self, params: SamplingParams) -> None:
        for name, ids in (("stop_token_ids", params.stop_token_ids or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{name}: token ids {bad[:5]} are outside the vocabulary "
                                          f"(0..{self.vocab_size - 1})", param=name)

    def _check_tokenizer_fields(self, params: SamplingParams) -> None:
        """Fields that read text need a tokenizer (a dummy model may have none)."""
        if self.tokenizer is not None:
            return
        if params.stop_strings:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)",
                                      param="stop")
        for field, used in (("bad_words", params.bad_words),
                            ("structured_outputs", params.structured_outputs is not None)):
            if used:
                raise InvalidRequestError(f"{field} needs a tokenizer; this model has none", param=field)

    def thinking_tags(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, int, bool]:
        """thinking_token_budget's tags and whether the answer starts inside a block
        (pagedserve/reasoning.py).  Refused by name where the tags are not single tokens
        of the vocabulary, or where something else forbids the end tag the budget forces:
        a bad word, allowed_token_ids without it, or a grammar that starts before the block
        the prompt opened ends."""
        tok = self.tokenizer
        ids = [tok.convert_tokens_to_ids(tag) if tok is not None else None for tag in (START, END)]
        if not all(isinstance(i, int) and i != tok.unk_token_id and 0 <= i < self.vocab_size for i in ids):
            raise InvalidRequestError(f"thinking_token_budget needs a thinking model, whose vocabulary has {START} "
                                      f"and {END} tokens; this model's has not", param="thinking_token_budget")
        start, end = ids
        if [end] in params.bad_words_token_ids:
            raise InvalidRequestError(f"thinking_token_budget forces {END} once spent, which bad_words forbid",
                                      param="thinking_token_budget")
        if params.allowed_token_ids is not None and end not in params.allowed_token_ids:
            raise InvalidRequestError(f"thinking_token_budget forces {END} (token {end}) once spent, which "
                                      "allowed_token_ids leave out", param="thinking_token_budget")
        inside = answer_starts_inside(prompt_ids, start, end, special_token_ids(tok))
        grammar = params.structured_outputs
        if inside and grammar is not None and grammar.after_token != end:
            raise InvalidRequestError(f"thinking_token_budget forces {END} once spent, but this answer starts inside "
                                      "a reasoning block under a grammar that starts at once (with "
                                      f"--reasoning-parser, chat starts it after {END})",
                                      param="thinking_token_budget")
        return start, end, inside

    def prediction_token_ids(self, prediction: str | list[int] | None) -> list[int] | None:
        """A predicted output's token ids (tokenized once, here): text no longer than a
        prompt may be, ids inside the vocabulary, and no more than max_model_len tokens
        either way (more could never be drafted).  Drafts need each step's tokens before the next
        step is scheduled, so overlap scheduling cannot use one: refused there by name."""
        if prediction is None:
            return None
        if self.config.scheduler_config.async_scheduling:
            raise InvalidRequestError("prediction is not supported with overlap scheduling (async_scheduling): its "
                                      "drafts follow each step's tokens, which a launched step does not know yet",
                                      param="prediction")
        limit = self.config.scheduler_config.max_model_len
        if isinstance(prediction, list):
            if len(prediction) > limit:
                raise InvalidRequestError(f"prediction has {len(prediction)} token ids, more than max_model_len "
                                          f"({limit})", param="prediction")
            bad = [t for t in prediction if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prediction: token ids {bad[:5]} are outside the vocabulary "
                                          f"(0..{self.vocab_size - 1})", param="prediction")
            return list(prediction)
        if self.tokenizer is None:
            raise InvalidRequestError("prediction text needs a tokenizer; this model has none (send token ids)",
                                      param="prediction")
        if len(prediction) > self.max_prompt_chars:
            raise InvalidRequestError(f"prediction is {len(prediction)} characters, more than the "
                                      f"{self.max_prompt_chars} that max_model_len tokens of this model can spell",
                                      param="prediction")
        ids = list(self.tokenizer.encode(prediction, add_special_tokens=False))
        if len(ids) > limit:  # (the character bound assumes a few characters a token; emoji are 2 tokens each)
            raise InvalidRequestError(f"prediction is {len(ids)} tokens, more than max_model_len ({limit})",
                                      param="prediction")
        return ids

    def check_lora(self, lora_request: Any) -> None:
        """A LoRA request may run here: LoRA is enabled and it is a LoRARequest."""
        if self.config.lora_config is None:
            raise InvalidRequestError("LoRA adapters are not enabled: start the engine with enable_lora=True "
                                      "(--enable-lora)", param="model")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")

    # ------------------------------------------------------------------ per-request preparation
    def child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """The scheduler's copy: n = 1, a distinct seed per sample, model EOS ids as stops,
        prompt logprobs asked of the first sample only.  The caller's object is never modified (it may be shared by many prompts)."""
        extra = [] if params.ignore_eos else [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        if params.n == 1 and not extra:
            return params
        child = copy.copy(params)
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + index
        if index and params.prompt_logprobs is not None:
            # The first sample scores the prompt for all of them (OutputProcessor keeps its
            # count); the others may then read its cached blocks.  Each computed every
            # prompt position and its top-k again: n=16 on a 1,900-token prompt took 53 s
            # against 3.3 s, while other requests waited.
            child.prompt_logprobs = None
        if extra:
            child.stop_token_ids = list(params.stop_token_ids) + extra
        return child

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word as the tokenizer writes it alone and after a space, whatever spaces it
        starts with (vLLM's rule: " Paris" banned only the spaced token)."""
        seqs: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """A pooling request's params checked against this model and completed from its
        PoolerConfig (a copy: the caller's object may be shared by many prompts)."""
        pooler = self.model_config.pooler_config
        if pooler is None:
            raise InvalidRequestError("embedding and scoring need the pooling runner: start the engine with "
                                      "runner='pooling' (`pagedserve serve MODEL --runner pooling`)", param="model")
        params.validate()
        hidden = getattr(self.model_config.hf_config, "hidden_size", None)
        if params.dimensions is not None and hidden is not None and params.dimensions > hidden:
            raise InvalidRequestError(f"dimensions must be at most the model's hidden size {hidden}, got "
                                      f"{params.dimensions}", param="dimensions")
        resolved = copy.copy(params)
        resolved.pooling_type = params.pooling_type or pooler.pooling_type
        if params.normalize is None:
            resolved.normalize = pooler.normalize
        if params.task == "classify":
            resolved.classifier_token_ids = self.classifier_token_ids
            if resolved.classifier_token_ids is None:
                raise InvalidRequestError("task 'classify' needs classifier tokens: start the engine with "
                                          "pooler_config {\"classifier_from_token\": [\"no\", \"yes\"]}",
                                          param="task")
        return resolved

    # ------------------------------------------------------------------ chat
    @property
    def chat_template(self) -> str | None:
        """The template chat prompts use by default: --chat-template, else the tokenizer's."""
        if self.tokenizer is None:
            return None
        return self.model_config.chat_template or getattr(self.tokenizer, "chat_template", None) or None

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render one conversation to prompt text (chat_utils.render_chat says how)."""
        return render_chat(self.tokenizer, self.chat_template, messages, chat_template, add_generation_prompt,
                           max_chars=self.max_prompt_chars, content_parts=self.image_prompts is not None, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        """Chat prompt as {'prompt', 'prompt_token_ids'} and, when the messages hold
        images, 'multi_modal' (the expanded prompt: process() takes the dict as it is).
        The template already holds any BOS text, so the tokenizer must not add special
        tokens a second time."""
        messages, sources = take_images(messages) if isinstance(messages, list) else (messages, [])
        if sources:  # (before rendering: a text model's template may fail on the image parts)
            self.check_image_count(sources)
        # A special token's string in a message stays text (special_text.py); the template
        # wrote any BOS already (vLLM's add_special_tokens: the tokenizer's too).
        add_special_tokens = kwargs.pop("add_special_tokens", False)
        if add_special_tokens and sources:
            raise InvalidRequestError("add_special_tokens is not supported with images", param="add_special_tokens")
        kwargs.setdefault("max_chars", self.max_prompt_chars)
        messages, hidden = hide_client_text(self.tokenizer, messages, kwargs)
        text = render_chat(self.tokenizer, self.chat_template, messages, chat_template, add_generation_prompt,
                           content_parts=self.image_prompts is not None, **kwargs)
        if not sources:
            ids = encode_rendered(self.tokenizer, hidden, text, self.max_prompt_chars, add_special_tokens,
                                  kwargs.get("cut", False))
            return {"prompt": hidden.shown(text), "prompt_token_ids": ids}
        prompt = self.expand_images(text, sources, lambda piece: hidden.encode(self.tokenizer, piece))
        return {"prompt": hidden.shown(text), "prompt_token_ids": prompt.prompt_token_ids, "multi_modal": prompt}
