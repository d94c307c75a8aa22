"""SGLang's wire formats: request validation and response bodies, as the real server shapes them.

See shared/sglang-contract.md. Chunk bodies are built from templates split around the one field
that changes, so a chunk costs one small JSON encode.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import orjson

# "responses": a Responses API request, generated as the chat it stands for (responses.py).
Kind = Literal["chat", "completion", "responses", "generate"]

# EOS id that SGLang reports in `matched_stop` when a Llama-3 model stops on its own.
EOS_TOKEN_ID = 128009
# SGLang's default `max_new_tokens` on the native /generate API.
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128
# Per-message overhead of a chat template (role header and end-of-turn tokens).
CHAT_TEMPLATE_TOKENS_PER_MESSAGE = 4

_WORDS = (
    "the big gpu ran one new job and its set did not fit yet now two old men had all the few who see "
    "how far our low bar can get per day"
).split()
# One simulated token = one three-letter word with its leading space: four bytes of plain ASCII, as
# `count_tokens` counts a prompt, so a reply resent in the next turn counts the tokens it had.
TOKENS = tuple(" " + w for w in _WORDS)


class RequestError(Exception):
    """A request SGLang would reject with 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def error_body(message: str, status: int, err_type: str) -> bytes:
    return orjson.dumps({"object": "error", "message": message, "type": err_type, "param": None, "code": status})


def count_tokens(text: str) -> int:
    """A tokenizer stand-in: about four bytes of text per token."""
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / 4)


def token_text(start: int, n: int) -> str:
    """Text of output tokens [start, start + n): deterministic, so runs can be compared."""
    size = len(TOKENS)
    return "".join(TOKENS[i % size] for i in range(start, start + n))


@dataclass(frozen=True)
class GenRequest:
    kind: Kind
    rid: str
    model: str
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_new_tokens: int
    # True when the client set no length: the simulated model then stops on EOS ("stop").
    natural_stop: bool
    # The prompt as text: chat message contents joined by newlines, the completion prompt or
    # /generate's `text`; "" for token ids.
    prompt_text: str = ""
    # What the prefix cache keys the prompt by: its text as the model sees it (a chat rendered
    # through a template), or its token ids.
    cache_data: bytes | tuple[int, ...] | None = None


def parse_request(kind: Kind, body: Any, served_model: str, default_max_tokens: int) -> GenRequest:
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    stream = _opt_bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object.", "stream_options")
        include_usage = _opt_bool(stream_options, "include_usage", "stream_options.include_usage")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("rid must be a string.", "rid")
    model = body.get("model", served_model)
    if not isinstance(model, str):
        raise RequestError("model must be a string.", "model")

    if kind == "chat":
        prompt_tokens = _chat_prompt_tokens(body.get("messages"))
        max_tokens = _opt_positive_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _opt_positive_int(body, "max_tokens")
    elif kind == "completion":
        prompt_tokens = _completion_prompt_tokens(body.get("prompt"))
        max_tokens = _opt_positive_int(body, "max_tokens")
    else:
        prompt_tokens = _generate_prompt_tokens(body)
        params = body.get("sampling_params", {})
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object.", "sampling_params")
        max_tokens = _opt_positive_int(params, "max_new_tokens", "sampling_params.max_new_tokens")
        if max_tokens is None:
            max_tokens = GENERATE_DEFAULT_MAX_NEW_TOKENS
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("Only n=1 is supported by the simulator.", "n")
    return GenRequest(
        kind=kind,
        rid=rid or uuid.uuid4().hex,
        model=model,
        stream=stream,
        include_usage=include_usage,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        natural_stop=max_tokens is None,
        prompt_text=_prompt_text(kind, body),
        cache_data=_cache_data(kind, body),
    )


def fit_pool(req: GenRequest, pool_tokens: int) -> GenRequest:
    """SGLang's scheduler refuses a prompt the KV pool cannot hold and shortens an output that
    would not fit beside it (`max_req_input_len`, then max_new_tokens clipped to the room left)."""
    if req.prompt_tokens >= pool_tokens:
        raise RequestError(
            f"Input length ({req.prompt_tokens} tokens) exceeds the maximum allowed length "
            f"({pool_tokens - 1} tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    room = pool_tokens - req.prompt_tokens
    if req.max_new_tokens <= room:
        return req
    return dataclasses.replace(req, max_new_tokens=room, natural_stop=False)


def _cache_data(kind: Kind, body: dict[str, Any]) -> bytes | tuple[int, ...] | None:
    """The prompt as the prefix cache sees it. A chat is rendered with role headers and an
    end-of-turn after each message, then the assistant's header: a conversation resent with the
    reply appended (as chat clients do) starts with the bytes the finished request left cached."""
    if kind == "chat":
        parts: list[str] = []
        for message in body["messages"]:
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"<|{message['role']}|>\n{content or ''}<|eot|>\n")
        parts.append("<|assistant|>\n")
        return "".join(parts).encode("utf-8", "surrogatepass")
    prompt = body.get("prompt") if kind == "completion" else (body.get("text") or body.get("input_ids"))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    return None


def check_context(req: GenRequest, context_len: int) -> None:
    """SGLang's length check (TokenizerManager._validate_one_request): the prompt must be shorter
    than the context, and prompt + a requested length too (`>=` fails, as there). Answered 400
    with these messages, streaming or not (since SGLang starts the stream before its 200)."""
    if req.prompt_tokens >= context_len:
        raise RequestError(
            f"The input ({req.prompt_tokens} tokens) is longer than the model's context length ({context_len} tokens)."
        )
    total = req.prompt_tokens + req.max_new_tokens
    if not req.natural_stop and total >= context_len:
        raise RequestError(
            "Requested token count exceeds the model's maximum context length "
            f"of {context_len} tokens. You requested a total of {total} "
            f"tokens: {req.prompt_tokens} tokens from the input messages and "
            f"{req.max_new_tokens} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )


def _prompt_text(kind: Kind, body: dict[str, Any]) -> str:
    """The text a request's acceptance is judged by, from a body `parse_request` already validated.
    A chat's is its last user message: the task the reply answers (an edit of code it quotes, or a
    question), not the system prompt it shares with every other conversation or the replies the
    model wrote before, which would make every long conversation read alike."""
    if kind == "chat":
        messages = body["messages"]
        users = [m for m in messages if m.get("role") == "user"]
        parts: list[str] = []
        for message in users[-1:] or messages:
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        return "\n".join(parts)
    prompt = body.get("prompt") if kind == "completion" else body.get("text")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def _opt_bool(obj: dict[str, Any], key: str, name: str | None = None) -> bool:
    value = obj.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name or key} must be a boolean.", name or key)
    return value


def _opt_positive_int(obj: dict[str, Any], key: str, name: str | None = None) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name or key} must be an integer.", name or key)
    if value <= 0:
        raise RequestError(f"{name or key} must be positive, got {value}.", name or key)
    return value


def _chat_prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list.", "messages")
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role.", "messages")
        content = message.get("content")
        if isinstance(content, str):
            total += count_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += count_tokens(part["text"])
        elif content is not None:
            raise RequestError(f"messages[{i}].content must be a string or a list.", "messages")
        total += CHAT_TEMPLATE_TOKENS_PER_MESSAGE
    return total


def _completion_prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return max(1, count_tokens(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return max(1, count_tokens(prompt[0]))
        raise RequestError("The simulator takes one prompt per request.", "prompt")
    raise RequestError("prompt must be a string or a list of token ids.", "prompt")


def _generate_prompt_tokens(body: dict[str, Any]) -> int:
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, str):
        return max(1, count_tokens(text))
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return len(ids)
    raise RequestError("Either text or input_ids must be provided.", "text")


# ---------------------------------------------------------------------------------------------
# Responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """`cached_tokens` None: the server does not report them (SGLang without --enable-cache-report)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
    }


def finish_reason(req: GenRequest) -> tuple[str, int | None]:
    return ("stop", EOS_TOKEN_ID) if req.natural_stop else ("length", None)


_SPLIT = "\x00split\x00"
_SPLIT_JSON = orjson.dumps(_SPLIT)


def _template(obj: dict[str, Any]) -> tuple[bytes, bytes]:
    head, tail = orjson.dumps(obj).split(_SPLIT_JSON)
    return b"data: " + head, tail + b"\n\n"


class StreamFormatter:
    """SSE events of one streamed response: role, content, finish, usage, [DONE]."""

    def __init__(self, req: GenRequest, created: int, report_cache: bool = False) -> None:
        self.req = req
        self._report_cache = report_cache
        self._head = {"id": req.rid, "object": "", "created": created, "model": req.model}
        if req.kind == "chat":
            self._head["object"] = "chat.completion.chunk"
            choice = {
                "index": 0,
                "delta": {"content": _SPLIT},
                "logprobs": None,
                "finish_reason": None,
                "matched_stop": None,
            }
        else:
            self._head["object"] = "text_completion"
            choice = {"index": 0, "text": _SPLIT, "logprobs": None, "finish_reason": None, "matched_stop": None}
        self._pre, self._post = _template({**self._head, "choices": [choice]})
        self._generated_text: list[str] = []

    def opening(self) -> bytes:
        """Sent as soon as the request is taken: nothing, here (see responses.ResponsesStream)."""
        return b""

    def first(self) -> bytes:
        """Sent once the first token exists (as SGLang does), before that token's own chunk."""
        if self.req.kind != "chat":
            return b""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
            "matched_stop": None,
        }
        return self._event({**self._head, "choices": [choice]})

    def content(self, start: int, n: int) -> bytes:
        text = token_text(start, n)
        if self.req.kind == "generate":
            self._generated_text.append(text)
            return self._generate_event(None, start + n)
        return self._pre + orjson.dumps(text) + self._post

    def finish(self, completion_tokens: int, cached_tokens: int = 0, verify_steps: int | None = None) -> bytes:
        """The last events. `verify_steps`: a speculative server's decode steps, which SGLang's
        native API gives a finished request (`meta_info.spec_verify_ct`)."""
        reason, matched = finish_reason(self.req)
        if self.req.kind == "generate":
            last = self._generate_event(reason, completion_tokens, cached_tokens, verify_steps)
            return last + b"data: [DONE]\n\n"
        if self.req.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None}
        else:
            choice = {"index": 0, "text": "", "logprobs": None}
        choice.update(finish_reason=reason, matched_stop=matched)
        out = self._event({**self._head, "choices": [choice]})
        if self.req.include_usage:
            cached = cached_tokens if self._report_cache else None
            use = usage(self.req.prompt_tokens, completion_tokens, cached)
            out += self._event({**self._head, "choices": [], "usage": use})
        return out + b"data: [DONE]\n\n"

    def _generate_event(
        self, reason: str | None, completion_tokens: int, cached_tokens: int = 0, verify_steps: int | None = None
    ) -> bytes:
        # The native API streams the whole text so far, not a delta.
        meta: dict[str, Any] = {
            "id": self.req.rid,
            "finish_reason": None if reason is None else {"type": reason, "length": completion_tokens},
            "prompt_tokens": self.req.prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens,
        }
        if verify_steps is not None:
            meta["spec_verify_ct"] = verify_steps
        return self._event({"text": "".join(self._generated_text), "meta_info": meta})

    @staticmethod
    def _event(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"


def full_response(
    req: GenRequest,
    created: int,
    completion_tokens: int,
    latency_s: float,
    cached_tokens: int = 0,
    report_cache: bool = False,
    verify_steps: int | None = None,
) -> bytes:
    text = token_text(0, completion_tokens)
    reason, matched = finish_reason(req)
    if req.kind == "generate":
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": {"type": reason, "length": completion_tokens},
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens,
            "e2e_latency": latency_s,
        }
        if verify_steps is not None:
            meta["spec_verify_ct"] = verify_steps
        return orjson.dumps({"text": text, "meta_info": meta})
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None},
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
        obj = "text_completion"
    choice.update(finish_reason=reason, matched_stop=matched)
    return orjson.dumps(
        {
            "id": req.rid,
            "object": obj,
            "created": created,
            "model": req.model,
            "choices": [choice],
            "usage": usage(req.prompt_tokens, completion_tokens, cached_tokens if report_cache else None),
        }
    )
