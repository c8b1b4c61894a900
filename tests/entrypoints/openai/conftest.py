"""A real `pagedserve serve` subprocess on a free loopback port, serving a tiny
random-weight Llama whose byte-level BPE tokenizer is trained here (offline, in
milliseconds).  One server for the whole session keeps the suite fast."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from pagedserve.benchmarks.harness import PagedServe, metric_samples

CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for call in m.get('tool_calls', []) %}<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. What is the capital of Italy? Rome is.",
    "user assistant system: answer politely and briefly, in one sentence.",
    "1 2 3 4 5 6 7 8 9 10 numbers count up; letters a b c d e f g go on.",
]
REPO_ROOT = Path(__file__).resolve().parents[3]
API_KEY = "test-key"
MODEL_NAME = "tiny-llama"


def train_tokenizer(corpus: list[str], vocab_size: int, added: list[str]):
    """A byte-level BPE tokenizer trained on `corpus` (in milliseconds), ChatML's special
    tokens, and `added` as plain (not special) tokens, as Qwen's vocabulary has them."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Only printable-ASCII bytes in the vocabulary: random sampling then never produces half
    # of a UTF-8 character, so per-token strings concatenate to the text exactly.
    # GPT-2's byte-to-unicode map: printable bytes stand for themselves, space and newline
    # are shifted past 255 ("Ġ", "Ċ").
    alphabet = [chr(b) for b in range(33, 127)] + [chr(256 + 32), chr(256 + 10)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    backend.train_from_iterator(corpus * 5, trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_tokens(added)
    return tok


def make_tiny_model(path: Path, seed: int = 0) -> None:
    import torch
    import transformers

    tok = train_tokenizer(_CORPUS, 384, ["<tool_call>", "</tool_call>"])
    tok.chat_template = CHAT_TEMPLATE
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class ServerProcess(PagedServe):
    """`pagedserve serve` for a test: one OpenMP thread, this checkout on the path."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 180,
                 module: str = "pagedserve.entrypoints.cli", env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
        super().__init__(args, str(log_path), env=env, ready_timeout=timeout, module=module)
        self.log_path = log_path

    def log(self) -> str:
        return self.log_tail()

    def log_mark(self) -> int:
        """Where the log ends now: log_since(mark) is what the server logged after it (the
        session's server is shared by the test files of a worker, so its log holds theirs)."""
        return self.log_path.stat().st_size

    def log_since(self, mark: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """{(sample name, sorted labels without model_name and engine): value}, summed over
        engines (data-parallel replicas)."""
        text = httpx.get(self.url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {API_KEY}"}).text
        out: dict[tuple[str, tuple], float] = {}
        for name, samples in metric_samples(text).items():
            for labels, value in samples:
                key = (name, tuple(sorted((k, v) for k, v in labels.items() if k not in ("model_name", "engine"))))
                out[key] = out.get(key, 0.0) + value
        return out


SERVER_FLAGS = ["--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--dtype", "float32", "--tool-call-parser", "hermes",
                "--max-model-len", "256", "--max-num-seqs", "64", "--kv-cache-memory-bytes", "16MiB",
                "--enforce-eager", "--seed", "0", "--log-stats-interval", "2",
                # Adapters enabled (none loaded): base requests must run as without them, and the
                # runtime load route is there to be fuzzed.
                "--enable-lora", "--allow-runtime-lora-updating"]


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    proc = ServerProcess([str(tiny_model_dir), *SERVER_FLAGS], tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()
