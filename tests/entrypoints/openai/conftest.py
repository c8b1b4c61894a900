"""A real `pagedserve serve` subprocess on a free loopback port, serving a tiny
random-weight Llama whose byte-level BPE tokenizer is trained here (offline, in
milliseconds).  One server for the whole session keeps the suite fast."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

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


def make_tiny_model(path: Path) -> None:
    import torch
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
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    backend.train_from_iterator(_CORPUS * 5, trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # plain (not special) tokens, as in Qwen's vocabulary
    tok.chat_template = CHAT_TEMPLATE
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, timeout: float = 180,
                 module: str = "pagedserve.entrypoints.cli", env: dict[str, str] | None = None) -> None:
        """`module`: what `python -m` runs (a test's launcher that injects a fault)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
        cmd = [sys.executable, "-m", module, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """{(sample name, sorted labels without model_name and engine): value}, summed over
        engines (data-parallel replicas)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {API_KEY}"}).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
                out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


SERVER_FLAGS = ["--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--dtype", "float32", "--tool-call-parser", "hermes",
                "--max-model-len", "256", "--max-num-seqs", "64", "--kv-cache-memory-bytes", "16MiB",
                "--enforce-eager", "--seed", "0", "--log-stats-interval", "2"]


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    proc = ServerProcess([str(tiny_model_dir), *SERVER_FLAGS], tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()
