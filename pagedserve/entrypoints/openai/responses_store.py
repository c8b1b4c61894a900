"""The response store of the Responses API (`--enable-responses-store`): what
`GET /v1/responses/{id}`, `input_items` and `previous_response_id` read."""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from typing import Any

from pagedserve.engine.chat_utils import holds_image
from pagedserve.entrypoints.openai.protocol_responses import ResponsesRequest, object_id
from pagedserve.request_limits import RESPONSES_STORE_MAX_BYTES, RESPONSES_STORE_MAX_ENTRIES


class ResponseStore:
    """Responses by id with the conversation that led to each (chat messages), oldest
    dropped first past `max_entries` or `max_bytes`.  Each is kept as its JSON text and
    `max_bytes` counts that text's memory: kept as Python objects, five 14 MiB requests
    of nested empty lists held 1.08 GB at rest under a 64 MiB bound that counted JSON
    characters.  Thread-safe: the handlers prepare requests off the event loop."""

    def __init__(self, max_entries: int = RESPONSES_STORE_MAX_ENTRIES,
                 max_bytes: int = RESPONSES_STORE_MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        # 3 JSON texts, whether the conversation holds an image, bytes
        self._items: OrderedDict[str, tuple[str, str, str, bool, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _texts(response: dict[str, Any], conversation: list[dict[str, Any]],
               input_items: list[dict[str, Any]] | None) -> tuple[tuple[str, str, str], int]:
        """The three JSON texts an entry keeps, and the memory they take."""
        texts = (json.dumps(response), json.dumps(conversation), json.dumps(input_items or []))
        return texts, sum(sys.getsizeof(t) for t in texts)

    def has_room(self, conversation: list[dict[str, Any]], input_items: list[dict[str, Any]] | None) -> bool:
        """Whether an entry of this conversation could be kept at all (before its answer):
        past the whole store's bytes it never is."""
        return self._texts({}, conversation, input_items)[1] <= self.max_bytes

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            input_items: list[dict[str, Any]] | None = None) -> bool:
        """Keep `response` with the conversation that led to it (chat messages) and the
        request's input items (what GET .../input_items lists); False where it is larger
        than the whole store, and not kept."""
        texts, size = self._texts(response, conversation, input_items)
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(response["id"], None)
            if old is not None:
                self._bytes -= old[-1]
            images = any(isinstance(m, dict) and holds_image(m.get("content")) for m in conversation)
            self._items[response["id"]] = (*texts, images, size)
            self._bytes += size
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped[-1]
        return True

    @property
    def num_bytes(self) -> int:
        """The memory the stored texts take."""
        return self._bytes

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response, its conversation), or None."""
        with self._lock:
            item = self._items.get(response_id)
        return None if item is None else (json.loads(item[0]), json.loads(item[1]))

    def holds_image(self, response_id: str) -> bool:
        """Whether the conversation of a kept response carries an image (read before a
        model loads, without parsing the conversation on the event loop)."""
        with self._lock:
            item = self._items.get(response_id)
        return item is not None and item[3]

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            item = self._items.get(response_id)
        return None if item is None else json.loads(item[2])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            item = self._items.pop(response_id, None)
            if item is not None:
                self._bytes -= item[-1]
        return item is not None


# The keys each kind of input item is listed back with (OpenAI's item shapes).
_ITEM_KEYS = {"message": ("type", "id", "role", "content", "status"),
              "function_call": ("type", "id", "call_id", "name", "arguments", "status"),
              "function_call_output": ("type", "id", "call_id", "output", "status")}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as OpenAI lists it back: typed items with ids and a status, a
    message's text as content parts (input_text; output_text for an assistant's), and
    only the keys of the item's kind."""
    items = []
    for item in [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input:
        kind = item.get("type", "message")
        out = {k: item[k] for k in _ITEM_KEYS.get(kind, tuple(item)) if k in item}
        out.update(type=kind, status=item.get("status") or "completed")
        out.setdefault("id", object_id("msg" if kind == "message" else "fc" if kind == "function_call" else "item"))
        if kind == "message" and isinstance(out.get("content"), str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": out["content"]}]
        items.append(out)
    return items
