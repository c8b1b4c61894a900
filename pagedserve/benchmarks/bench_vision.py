"""Image requests on a SmolVLM-256M-shaped model with random weights: requests per
second and time to first token for one 448x448 image per request, against HF
transformers on the same checkpoint in the same process, and what the encoder cache
saves when an image comes again.

The checkpoint is SmolVLM-256M-Instruct's shape (a 30-layer Llama of width 576, a
12-layer SigLIP tower of width 768 on 512-pixel tiles, pixel shuffle by 4: 64 rows per
tile) with random weights, the tokenizer SmolLM2's (the embedded default model's) with
SmolVLM's image tokens added.  Answers are random text; the work is the real model's.

    python -m pagedserve.benchmarks.bench_vision
    python -m pagedserve.benchmarks.bench_vision --requests 8 --no-hf

A benchmark: it prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.cpu_info import describe_cpu

IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
TEMPLATE = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
            "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
            "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
            "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
            "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
PROMPT = "<|im_start|>User:<image>Describe this picture.<end_of_utterance>\nAssistant:"


def make_checkpoint(path: str, seed: int = 0) -> None:
    """SmolVLM-256M's shape, random weights (normal, std 0.02), float32 on disk."""
    import transformers
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from pagedserve.model_loader.sources import resolve_source

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(resolve_source("smollm2-135m-instruct", "auto").path)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tok.chat_template = TEMPLATE
    text = dict(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.convert_tokens_to_ids("<end_of_utterance>"), pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=512, patch_size=16)
    config = transformers.SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=4,
                                        image_token_id=tok.convert_tokens_to_ids("<image>"))
    config.architectures = ["SmolVLMForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.SmolVLMForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    SmolVLMImageProcessorPil(size={"longest_edge": 512}, max_image_size={"longest_edge": 512}).save_pretrained(path)


def images(n: int, seed: int) -> list[Any]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)) for _ in range(n)]


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def ours(path: str, n: int, max_tokens: int) -> dict[str, float]:
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [{"prompt": PROMPT, "multi_modal_data": {"image": img}} for img in images(n + 3, 1)]
    out: dict[str, float] = {}
    for caching in (True, False):
        llm = LLM(path, max_model_len=2048, speculative_config="off", enable_prefix_caching=caching)
        llm.generate(prompt[:1], one, use_tqdm=False)  # warm-up
        _, first = timed(lambda llm=llm: llm.generate(prompt[1:2], one, use_tqdm=False))
        _, again = timed(lambda llm=llm: llm.generate(prompt[1:2], one, use_tqdm=False))
        if caching:
            out["ttft"], out["again"] = first, again
            _, batch = timed(lambda llm=llm: llm.generate(prompt[3:3 + n], many, use_tqdm=False))
            out["rps"] = n / batch
            out["encoder_runs"] = llm.llm_engine.model_executor.images.encoder_runs
        else:
            out["encoder_cached"] = again
        del llm
    return out


def hf(path: str, n: int, max_tokens: int) -> dict[str, float]:
    import transformers
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    proc = transformers.Idefics3Processor(SmolVLMImageProcessorPil.from_pretrained(path), tok, image_seq_len=64)
    model = transformers.SmolVLMForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    imgs = images(n + 2, 1)

    def run(img: Any, tokens: int) -> None:
        inputs = proc(text=PROMPT, images=[img], add_special_tokens=False, return_tensors="pt")
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

    run(imgs[0], 1)
    _, ttft = timed(lambda: run(imgs[1], 1))
    _, total = timed(lambda: [run(img, max_tokens) for img in imgs[2:2 + n]])  # one at a time, as HF serves
    return {"ttft": ttft, "rps": n / total}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    p.add_argument("--dir", help="keep the checkpoint here (made if missing)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.dir or tmp
        if not os.path.isfile(os.path.join(path, "config.json")):
            make_checkpoint(path)
        print(f"CPU: {describe_cpu()}; torch threads {torch.get_num_threads()}")
        print(f"SmolVLM-256M shape, random weights, one 448x448 image per request, {args.requests} requests of "
              f"{args.max_tokens} tokens")
        got = ours(path, args.requests, args.max_tokens)
        print(f"pagedserve: TTFT {got['ttft']:.2f} s; the same image again {got['again']:.2f} s (prefix and encoder "
              f"cache), {got['encoder_cached']:.2f} s (encoder cache only, prefix caching off); {got['rps']:.2f} "
              f"requests/s ({args.requests} at once); the vision tower ran {got['encoder_runs']:.0f} times for "
              f"{args.requests + 3} requests of {args.requests + 2} distinct images")
        if not args.no_hf:
            ref = hf(path, args.requests, args.max_tokens)
            print(f"HF transformers: TTFT {ref['ttft']:.2f} s; {ref['rps']:.2f} requests/s (one at a time)")
            print(f"ratio (pagedserve / HF): TTFT {ref['ttft'] / got['ttft']:.2f}x faster, requests/s "
                  f"{got['rps'] / ref['rps']:.2f}x")


if __name__ == "__main__":
    main()
