"""Work in tokens: how many tokens a request brings to a server before any is generated. specgate has
no tokenizer (the model's is the server's); it counts the characters of the prompt's text that a chat
template renders and divides by the characters a token takes, a ratio learnt from what the servers'
`usage` reports of the requests they finished. Pure.

The ratio is each client's own (access.client_key: its API key's hash, else its address): a
client's text decides its ratio (code, prose, another script, or text made to fool an estimate),
so one client's requests scale that client's estimates and no one else's. A client without
evidence of its own yet is scaled by the fleet's ratio: the median of the clients' own, one vote
each, so that no one client moves it beyond where the others stand (with two clients, their mean).

The load this measures is what a request holds on its server (its lease's `tokens`): the prompt as
estimated here, plus the tokens generated so far as the relay sees them pass (observe.py).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass
from typing import Any

import orjson

from ..kinds import Endpoint

# Characters a token takes before anything is learnt: English text through a Llama-3 or GPT
# tokenizer. Chat templates add a few tokens a message (roles, turn ends).
CHARS_PER_TOKEN = 4.0
TEMPLATE_TOKENS_PER_MESSAGE = 4
# The learnt correction stays within these factors of the first guess: a server whose usage is
# nonsense must not make every estimate zero or unbounded.
MIN_RATIO, MAX_RATIO = 0.25, 4.0
# Weight of each finished request in a client's running mean of the ratio (about its last 50
# requests; its first ones are averaged plainly).
LEARN_WEIGHT = 0.02
# A client's finished requests before its own ratio scales its estimates, and votes in the fleet's.
OWN_AFTER = 3
# Clients whose ratio is kept (a few floats each), the least recently seen forgotten first.
MAX_CLIENTS = 1024
# The fleet's ratio is reckoned again after this many finished requests (a median over the clients).
RECKON_EVERY = 16
# Items of a prompt looked at: past this a body is one of the hostile kind, and its estimate is a floor.
MAX_ITEMS = 100_000


def prompt_estimate(payload: dict[str, Any], endpoint: Endpoint) -> int:
    """The prompt's tokens as first guessed from a request body (at least 1): the text a chat
    template renders, no field it leaves out (a client's extra fields would teach the ratio theirs)."""
    chars, tokens = 0, 0
    if endpoint == "chat":
        chars, tokens = _messages(payload.get("messages"))
    elif endpoint == "completions":
        chars, tokens = _prompt(payload.get("prompt"))
    elif endpoint == "responses":
        instructions = payload.get("instructions")
        chars = len(instructions) if isinstance(instructions, str) else 0
        given = payload.get("input")
        if isinstance(given, str):
            chars += len(given)
            tokens = TEMPLATE_TOKENS_PER_MESSAGE
        else:
            c, t = _items(given)
            chars, tokens = chars + c, t
    elif endpoint == "generate":
        chars, tokens = _prompt(payload.get("text") if "text" in payload else payload.get("input_ids"))
    else:  # embeddings and the like: an `input` of text or token ids
        chars, tokens = _prompt(payload.get("input"))
    if endpoint in ("chat", "responses") and isinstance(tools := payload.get("tools"), list) and tools:
        # The tools' schemas go into the prompt through the chat template, as JSON: an agent's are
        # often thousands of tokens, and left out they would teach every estimate (TokenRatio) a
        # ratio that is theirs. The body was parsed from JSON, so it serialises again, unless it
        # nests past orjson's writer (255 levels): such tools are the server's to refuse, uncounted.
        with contextlib.suppress(TypeError):  # orjson.JSONEncodeError is one
            chars += len(orjson.dumps(tools))
    return max(1, tokens + math.ceil(chars / CHARS_PER_TOKEN))


def _messages(messages: object) -> tuple[int, int]:
    """(characters of text, tokens already counted) of a chat's messages: each one's content (a
    string, or its text parts) and an assistant's tool calls (name and arguments), what chat
    templates render."""
    if not isinstance(messages, list):
        return 0, 0
    chars = 0
    for message in messages[:MAX_ITEMS]:
        if not isinstance(message, dict):
            continue
        chars += _content(message.get("content"), _CHAT_TEXT)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for call in calls[:MAX_ITEMS]:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    chars += _text(function.get("name")) + _text(function.get("arguments"))
    return chars, TEMPLATE_TOKENS_PER_MESSAGE * min(len(messages), MAX_ITEMS)


def _items(items: object) -> tuple[int, int]:
    """(characters of text, tokens already counted) of a Responses API input: its messages'
    content, its function calls' names and arguments and their outputs, by each item's type."""
    if not isinstance(items, list):
        return 0, 0
    chars = 0
    for item in items[:MAX_ITEMS]:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            chars += _content(item.get("content"), _RESPONSES_TEXT)
        elif kind == "function_call":
            chars += _text(item.get("name")) + _text(item.get("arguments"))
        elif kind == "function_call_output":
            chars += _text(item.get("output"))
    return chars, TEMPLATE_TOKENS_PER_MESSAGE * min(len(items), MAX_ITEMS)


# The content parts whose text a template renders (images and files are the server's to count).
_CHAT_TEXT = frozenset({"text"})
_RESPONSES_TEXT = frozenset({"input_text", "output_text", "text"})


def _content(content: object, kinds: frozenset[str]) -> int:
    if isinstance(content, str):
        return len(content)
    chars = 0
    if isinstance(content, list):
        for part in content[:MAX_ITEMS]:
            if isinstance(part, dict) and part.get("type") in kinds:
                chars += _text(part.get("text"))
    return chars


def _text(value: object) -> int:
    return len(value) if isinstance(value, str) else 0


def _prompt(prompt: object) -> tuple[int, int]:
    """A completion prompt: a string, a list of strings (a batch), or token ids (counted as such)."""
    if isinstance(prompt, str):
        return len(prompt), 0
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):
            return 0, len(prompt)
        return sum(len(p) if isinstance(p, str) else 0 for p in prompt[:MAX_ITEMS]), 0
    return 0, 0


@dataclass(slots=True)
class _Client:
    ratio: float
    finished: int = 0


class TokenRatio:
    """Prompt tokens the servers reported over what was estimated: each client's running mean, and
    the fleet's for clients without their own (the module's rule). `value` is the fleet's."""

    __slots__ = ("_clients", "_max_clients", "_since", "value")

    def __init__(self, max_clients: int = MAX_CLIENTS) -> None:
        self.value = 1.0
        self._max_clients = max_clients
        # By client key, the least recently seen first.
        self._clients: dict[str, _Client] = {}
        self._since = 0  # finished requests since the fleet's ratio was reckoned

    def __len__(self) -> int:
        return len(self._clients)

    def of(self, client: str) -> float:
        """The ratio that scales `client`'s estimates."""
        own = self._clients.get(client)
        return own.ratio if own is not None and own.finished >= OWN_AFTER else self.value

    def scaled(self, estimate: int, client: str = "") -> int:
        return max(1, round(estimate * self.of(client)))

    def learn(self, estimate: int, reported: int, client: str = "") -> None:
        """A finished request of `client`'s: `estimate` first guessed (unscaled), `reported` by its
        server's usage."""
        if estimate <= 0 or reported <= 0:
            return
        ratio = min(MAX_RATIO, max(MIN_RATIO, reported / estimate))
        own = self._clients.pop(client, None)
        if own is None:
            own = _Client(self.value)
            while len(self._clients) >= self._max_clients:
                del self._clients[next(iter(self._clients))]
        self._clients[client] = own
        own.finished += 1
        own.ratio += max(LEARN_WEIGHT, 1.0 / own.finished) * (ratio - own.ratio)
        self._since += 1
        if self._since >= RECKON_EVERY or len(self._clients) <= RECKON_EVERY:
            self._reckon()

    def _reckon(self) -> None:
        self._since = 0
        votes = [c.ratio for c in self._clients.values() if c.finished >= OWN_AFTER]
        if votes:
            self.value = statistics.median(votes)
