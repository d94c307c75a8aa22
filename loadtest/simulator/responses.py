"""The OpenAI Responses API (`POST /v1/responses`) as SGLang and vLLM serve it: a request is turned
into the chat it stands for (instructions as the system message, then the stored conversation it
continues, then its input), generated as that chat, and answered as a response object, or streamed
as typed events (`event: <type>` / `data: {...}`, numbered from 0 by `sequence_number`, no
`[DONE]`): `response.created` and `response.in_progress` at once, before the prompt is read; the
message's `added` events with the first token; one `response.output_text.delta` per decode step;
the `done` events and `response.completed`, whose response carries the usage, at the end.

A response is stored (unless the request said `"store": false`) with the conversation that led to
it, in a bounded table per server, so that `previous_response_id` continues it there and only
there: on another server that id is unknown, and the answer is SGLang's 404.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

import orjson

from .wire import GenRequest, RequestError, finish_reason, token_text

# Stored responses a server keeps; past this the oldest is forgotten (SGLang keeps every one).
STORE_CAPACITY = 10_000


class NotFound(RequestError):
    """A request naming a response this server does not hold: 404."""


class ResponseStore:
    """Response id -> the chat messages that response ended (its reply included)."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self._capacity = capacity
        self._kept: OrderedDict[str, tuple[dict[str, Any], ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def save(self, response_id: str, messages: tuple[dict[str, Any], ...], reply: str) -> None:
        self._kept[response_id] = (*messages, {"role": "assistant", "content": reply})
        while len(self._kept) > self._capacity:
            self._kept.popitem(last=False)

    def conversation(self, response_id: str) -> tuple[dict[str, Any], ...]:
        found = self._kept.get(response_id)
        if found is None:
            raise NotFound(f"Response with id '{response_id}' not found.", "response_id")
        return found


def chat_of(body: Any, store: ResponseStore) -> tuple[dict[str, Any], bool]:
    """The chat request a Responses request stands for (its `messages`, limit and stream flag),
    and whether its response is to be stored."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string.", "instructions")
        messages.append({"role": "system", "content": instructions})
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise RequestError("previous_response_id must be a string.", "previous_response_id")
        if not previous.startswith("resp_"):
            raise RequestError(
                f"Invalid 'response_id': '{previous[:100]}'. Expected an ID that begins with 'resp'.", "response_id"
            )
        # The stored system message gives way to this request's instructions, as in vLLM.
        messages.extend(m for m in store.conversation(previous) if m["role"] != "system" or not messages)
    messages.extend(_input_messages(body.get("input")))
    if not any(m["role"] != "system" for m in messages):
        raise RequestError("input must hold at least one message.", "input")
    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise RequestError("store must be a boolean.", "store")
    chat: dict[str, Any] = {"messages": messages, "stream": body.get("stream", False)}
    if "model" in body:
        chat["model"] = body["model"]
    limit = body.get("max_output_tokens")
    if limit is not None:
        chat["max_tokens"] = limit
    return chat, store_it


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """`input`: a string (one user message) or a list of items: messages (content a string or a list
    of parts with text), and the items a client sends back from earlier turns (function calls and
    their outputs), which the model reads as text."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("input must be a string or a non-empty list of items.", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be an object.", "input")
        kind = item.get("type", "message")
        if kind == "message" or "role" in item:
            role, content = item.get("role"), item.get("content")
            if not isinstance(role, str):
                raise RequestError(f"input[{i}] must have a role.", "input")
            if isinstance(content, list):
                content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            elif not isinstance(content, str):
                raise RequestError(f"input[{i}].content must be a string or a list of parts.", "input")
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            out.append({"role": "assistant", "content": str(item.get("arguments", ""))})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": str(item.get("output", ""))})
        # Reasoning items and others carry nothing the simulated model reads.
    return out


def response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def _usage(req: GenRequest, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": req.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": req.prompt_tokens + completion_tokens,
    }


class ResponseObject:
    """The response object of one request, as it stands at each point of its life."""

    def __init__(self, req: GenRequest, created: int, stored: bool) -> None:
        self.req = req
        self.item_id = "msg_" + uuid.uuid4().hex
        self._base: dict[str, Any] = {
            "id": req.rid,
            "object": "response",
            "created_at": created,
            "model": req.model,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "metadata": {},
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": stored,
            "background": False,
        }

    def message(self, text: str, done: bool) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [part] if done else [],
        }

    def body(self, completion_tokens: int | None, cached_tokens: int = 0) -> dict[str, Any]:
        """In progress (None), or ended after `completion_tokens`."""
        if completion_tokens is None:
            return {**self._base, "status": "in_progress", "output": [], "usage": None}
        ended = finish_reason(self.req)[0] == "length"
        return {
            **self._base,
            "status": "incomplete" if ended else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if ended else None,
            "output": [self.message(token_text(0, completion_tokens), True)],
            "usage": _usage(self.req, completion_tokens, cached_tokens),
        }


class ResponsesStream:
    """The typed events of one streamed response; the same calls as wire.StreamFormatter."""

    def __init__(self, req: GenRequest, created: int, stored: bool) -> None:
        self._obj = ResponseObject(req, created, stored)
        self._seq = 0
        self._where = {"item_id": self._obj.item_id, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = orjson.dumps({"type": kind, **fields, "sequence_number": self._seq})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def opening(self) -> bytes:
        """Sent as soon as the request is taken, before its prompt is read."""
        body = self._obj.body(None)
        return self._event("response.created", {"response": body}) + self._event(
            "response.in_progress", {"response": body}
        )

    def first(self) -> bytes:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._event(
            "response.output_item.added", {"output_index": 0, "item": self._obj.message("", False)}
        ) + self._event("response.content_part.added", {**self._where, "part": part})

    def content(self, start: int, n: int) -> bytes:
        return self._event("response.output_text.delta", {**self._where, "delta": token_text(start, n), "logprobs": []})

    def finish(self, completion_tokens: int, cached_tokens: int = 0, verify_steps: int | None = None) -> bytes:
        """The response's last events (a Responses API response has no `meta_info` for verify_steps)."""
        text = token_text(0, completion_tokens)
        item = self._obj.message(text, True)
        return b"".join(
            (
                self._event("response.output_text.done", {**self._where, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {**self._where, "part": item["content"][0]}),
                self._event("response.output_item.done", {"output_index": 0, "item": item}),
                self._event("response.completed", {"response": self._obj.body(completion_tokens, cached_tokens)}),
            )
        )


def full_response(req: GenRequest, created: int, stored: bool, completion_tokens: int, cached_tokens: int) -> bytes:
    return orjson.dumps(ResponseObject(req, created, stored).body(completion_tokens, cached_tokens))
