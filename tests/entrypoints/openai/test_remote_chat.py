"""`pagedserve chat --url` (entrypoints/remote_chat.py): the chat loop against the real
server, as vLLM's `vllm chat --url`: the answers the API gives, the conversation carried
from turn to turn, a refusal printed and the turn dropped."""

from __future__ import annotations

import io

import httpx
import pytest
from conftest import API_KEY, MODEL_NAME

from pagedserve.entrypoints import cli


def api_answer(server, messages: list[dict]) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "temperature": 0.0})
    return r.json()["choices"][0]["message"]["content"]


def test_chat_url_asks_the_server_and_carries_the_conversation(server, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PAGEDSERVE_API_KEY", API_KEY)
    base = ["chat", "--url", server.url + "/v1", "--max-tokens", "6", "--temperature", "0"]
    cli.main([*base, "--quick", "hello world"])
    import logging

    assert logging.getLogger("httpx").level == logging.WARNING  # (its INFO line per request came mid-chat)
    first = api_answer(server, [{"role": "user", "content": "hello world"}])
    assert capsys.readouterr().out == first + "\n"
    # two turns and a refused one (an empty stop string), read from standard input
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world\nand then?\n/exit\n"))
    cli.main(base)
    second = api_answer(server, [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": first},
                                 {"role": "user", "content": "and then?"}])
    assert capsys.readouterr().out == f"{first}\n{second}\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n/exit\n"))
    with pytest.raises(SystemExit, match="1 of 1 turns refused"):  # (as the local chat: it exited 0)
        cli.main([*base, "--stop", ""])
    assert "error: 400" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--dtype sets up a model here"):
        cli.main([*base, "--dtype", "float32", "--quick", "x"])
    with pytest.raises(SystemExit, match="--pipeline-parallel-size sets up a model here"):  # (vLLM's: dropped)
        cli.main([*base, "-pp", "2", "--quick", "x"])
    with pytest.raises(SystemExit, match="cannot reach"):
        cli.main(["chat", "--url", "http://127.0.0.1:9/v1", "--quick", "x"])
    with pytest.raises(SystemExit, match="cannot reach http://\\[::1: Invalid port"):  # (a traceback: no HTTPError)
        cli.main(["chat", "--url", "http://[::1", "--quick", "x"])


def test_ctrl_c_mid_answer_keeps_the_chat_and_what_came(server, monkeypatch) -> None:
    """Ctrl-C during a remote answer stops it and the conversation goes on with the part
    that came (it ended the chat with a traceback), as a local chat does."""
    from pagedserve.entrypoints.remote_chat import RemoteChat

    chat = RemoteChat(server.url + "/v1", None, API_KEY, {"max_tokens": 6, "temperature": 0.0}, None)
    got: list[str] = []

    def write(piece: str) -> None:
        got.append(piece)
        if "".join(got):
            raise KeyboardInterrupt

    chat.turn("hello world", write)
    assert chat.history[-1] == {"role": "assistant", "content": "".join(got)} and got
    chat.turn("and then?", lambda piece: None)
    assert len(chat.history) == 4 and chat.history[2]["content"] == "and then?"
    chat = RemoteChat(server.url + "/v1", None, API_KEY, {}, "")
    assert chat.base == [{"role": "system", "content": ""}]  # (--system '': an empty system turn, not none)
