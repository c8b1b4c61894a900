"""The benchmark workloads, defined once for every script.

chat-burst: 32 chat requests (the 8 CHAT_BURST_MESSAGES, 4 times each) with the chat
template applied, greedy, 128 new tokens each, EOS ignored; chat-burst-natural: the
same, 256 tokens at most, EOS honoured; shared-prefix: 32 questions sharing a ~400-token
system message, 64 new tokens; edit-code: 8 chat requests that each give a 200-400 token
Python snippet and ask for it back with one small change (greedy, EOS honoured, 512 new
tokens at most: the copying that speculative decoding turns into several tokens a
step); predicted-edit: edit-code with each original snippet as the request's predicted
output (OpenAI's `prediction`, as an editor sends the file it edits); random:
nano-vllm's bench.py (see random_tokens).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

CHAT_BURST_MESSAGES = [
    "What is the capital of France?",
    "Write a haiku about autumn rain.",
    "Explain photosynthesis to a ten-year-old.",
    "List five prime numbers and say why they are prime.",
    "How do I reverse a list in Python?",
    "Give me three tips for better sleep.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]

SHARED_PREFIX_SYSTEM = (
    "You are a meticulous assistant for a public library. "
    + " ".join(
        f"Rule {i}: answer politely, cite the catalogue section, keep answers short, and never "
        f"invent a book that the library does not hold (section {i})."
        for i in range(1, 15)
    )
)

SHARED_PREFIX_QUESTIONS = [
    f"Question {i}: where would I find books about {topic}?"
    for i, topic in enumerate(
        ["astronomy", "cooking", "gardening", "history", "poetry", "chess", "birds", "trains"] * 4
    )
]


# (class name, noun, fields, the change asked for): each becomes one snippet of the
# edit-code workload.
_EDIT_CODE_SPECS = [
    ("Inventory", "item", ["name", "quantity", "price", "location"], "rename the method `total_value` to `stock_value`"),
    ("Library", "book", ["title", "author", "year", "shelf"], "make `find_by` ignore upper and lower case"),
    ("Gradebook", "student", ["name", "grade", "age", "group"], "add a docstring to `average`"),
    ("Garage", "car", ["model", "mileage", "year", "owner"], "rename the parameter `limit` to `max_count`"),
    ("Pantry", "jar", ["label", "weight", "expires", "shelf"], "change `total_value` to round its result to 2 decimals"),
    ("Roster", "player", ["name", "number", "position", "team"], "rename the class to `TeamRoster`"),
    ("Playlist", "song", ["title", "artist", "seconds", "genre"], "make `remove` return True when it removed something"),
    ("Warehouse", "crate", ["code", "weight", "zone", "client"], "add a type hint `-> int` to `count`"),
]


def _edit_code_snippet(cls: str, noun: str, fields: list[str]) -> str:
    a, b, c, d = fields
    return f"""class {cls}:
    def __init__(self):
        self.{noun}s = []

    def add(self, {a}, {b}, {c}, {d}):
        {noun} = {{"{a}": {a}, "{b}": {b}, "{c}": {c}, "{d}": {d}}}
        self.{noun}s.append({noun})
        return {noun}

    def remove(self, {a}):
        for {noun} in self.{noun}s:
            if {noun}["{a}"] == {a}:
                self.{noun}s.remove({noun})
                return
        return

    def find_by(self, key, value):
        return [{noun} for {noun} in self.{noun}s if {noun}[key] == value]

    def count(self):
        return len(self.{noun}s)

    def total_value(self):
        total = 0
        for {noun} in self.{noun}s:
            total += {noun}["{b}"] * 1.5
        return total

    def average(self):
        if not self.{noun}s:
            return 0
        return self.total_value() / len(self.{noun}s)

    def top(self, limit=3):
        ordered = sorted(self.{noun}s, key=lambda {noun}: {noun}["{b}"], reverse=True)
        return ordered[:limit]
"""


@dataclass
class Workload:
    name: str
    conversations: list[list[dict[str, str]]] | None  # chat workloads
    prompt_token_ids: list[list[int]] | None  # token-id workloads
    max_tokens: list[int]
    ignore_eos: bool
    temperature: float = 0.0
    predictions: list[str] | None = None  # each request's predicted output (SamplingParams.prediction)


def chat_burst(max_tokens: int = 128, ignore_eos: bool = True) -> Workload:
    convs = [[{"role": "user", "content": m}] for m in CHAT_BURST_MESSAGES * 4]
    return Workload("chat-burst", convs, None, [max_tokens] * len(convs), ignore_eos)


def chat_burst_natural() -> Workload:
    w = chat_burst(max_tokens=256, ignore_eos=False)
    w.name = "chat-burst-natural"
    return w


def shared_prefix(max_tokens: int = 64) -> Workload:
    convs = [
        [{"role": "system", "content": SHARED_PREFIX_SYSTEM}, {"role": "user", "content": q}]
        for q in SHARED_PREFIX_QUESTIONS
    ]
    return Workload("shared-prefix", convs, None, [max_tokens] * len(convs), True)


def edit_code(max_tokens: int = 512) -> Workload:
    convs = [[{"role": "user", "content": f"Here is some Python code:\n\n```python\n{_edit_code_snippet(cls, noun, fields)}"
                                          f"```\n\nPlease {change}. Reply with the complete updated code only."}]
             for cls, noun, fields, change in _EDIT_CODE_SPECS]
    return Workload("edit-code", convs, None, [max_tokens] * len(convs), False)


def predicted_edit(max_tokens: int = 512) -> Workload:
    w = edit_code(max_tokens)
    w.name = "predicted-edit"
    w.predictions = [_edit_code_snippet(cls, noun, fields) for cls, noun, fields, _ in _EDIT_CODE_SPECS]
    return w


def random_tokens(
    num_prompts: int = 256,
    input_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    vocab: int = 10000,
    seed: int = 0,
    temperature: float = 0.6,
) -> Workload:
    """nano-vllm's bench.py: random token-id prompts and lengths drawn with random.seed(seed)."""
    random.seed(seed)
    prompts = [
        [random.randint(0, vocab) for _ in range(random.randint(*input_len))] for _ in range(num_prompts)
    ]
    max_tokens = [random.randint(*output_len) for _ in range(num_prompts)]
    return Workload("random", None, prompts, max_tokens, True, temperature)
