"""`pagedserve chat --url URL`: the chat (cli.chat_loop) with a running OpenAI-compatible
server (this one, vLLM, llama-server), as vLLM's `vllm chat --url` talks to one, instead
of a model loaded in this process.  Each turn is one streamed POST /chat/completions
with the whole conversation; the answer's content is printed as it arrives (a thinking
model's reasoning, where the server splits it off, is not: it stays out of the next
turn's prompt, as the server's templates leave it out).  A server's error is printed and
the turn dropped, as a local refusal is.  httpx only: no engine, torch or model here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import httpx

from pagedserve import envs

# The sampling flags `chat` shares with its local loop, as the server's request fields,
# each sent only where it asks for something (OpenAI's own API refuses vLLM's top_k, ...).
NEUTRAL_SAMPLING: dict[str, Any] = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "stop": None,
                                    "ignore_eos": False, "seed": None}


def request_sampling(flags: dict[str, Any]) -> dict[str, Any]:
    """The chat request's sampling fields for `chat`'s flags: max_tokens and temperature,
    and each other one set to something other than its neutral value."""
    return {"max_tokens": flags["max_tokens"], "temperature": flags["temperature"],
            **{k: flags[k] for k, neutral in NEUTRAL_SAMPLING.items() if flags[k] != neutral}}


def api_key(given: str | None) -> str | None:
    """--api-key, else the environment's (the server's own variables, then OpenAI's)."""
    server = envs.api_key()
    return given or (server[1] if server else None) or os.environ.get("OPENAI_API_KEY")


# What a request to a server that cannot be reached raises (a malformed URL is no HTTPError).
UNREACHABLE = (httpx.HTTPError, httpx.InvalidURL)


class RemoteChat:
    """One conversation with the server at `url` (its OpenAI base URL, ".../v1")."""

    def __init__(self, url: str, model: str | None, key: str | None, sampling: dict[str, Any],
                 system: str | None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.client = httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {key}"} if key else {})
        self.model = model or self._first_model()
        self.sampling = sampling
        self.base = [{"role": "system", "content": system}] if system is not None else []
        self.history = list(self.base)

    def _first_model(self) -> str:
        try:
            r = self.client.get(f"{self.url}/models")
        except UNREACHABLE as e:
            raise ValueError(f"cannot reach {self.url}: {e}") from None
        if r.status_code != 200:
            raise ValueError(f"{self.url}/models answered {r.status_code}: {r.text[:200]}")
        data = r.json().get("data") or []
        if not data:
            raise ValueError(f"{self.url} serves no model")
        return data[0]["id"]

    def clear(self) -> None:
        self.history = list(self.base)

    def turn(self, text: str, write: Callable[[str], Any]) -> None:
        """Send `text`, write the answer's content as it streams; raise ValueError with the
        server's message when it refuses (the turn is then forgotten)."""
        messages = [*self.history, {"role": "user", "content": text}]
        body = {"model": self.model, "messages": messages, "stream": True, **self.sampling}
        reply: list[str] = []
        try:
            self._stream(body, reply, write)
        except UNREACHABLE as e:
            raise ValueError(f"cannot reach {self.url}: {e}") from None
        except KeyboardInterrupt:  # Ctrl-C: the answer stops (its closed stream aborts it on the server) and
            pass                   # what came of it stays in the conversation, as in a local chat
        self.history = [*messages, {"role": "assistant", "content": "".join(reply)}]

    def _stream(self, body: dict[str, Any], reply: list[str], write: Callable[[str], Any]) -> None:
        with self.client.stream("POST", f"{self.url}/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise ValueError(_error_text(r))
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise ValueError(event["error"].get("message", "the server failed the answer"))
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        reply.append(piece)
                        write(piece)


def _error_text(r: httpx.Response) -> str:
    try:
        return f"{r.status_code}: {r.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code}: {r.text[:300]}"
