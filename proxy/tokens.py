"""Work in tokens: how many tokens a request brings to a server before any is generated. specgate has
no tokenizer (the model's is the server's); it counts the characters of the prompt's text in the
body and divides by the characters a token takes, a ratio learnt from what the servers' `usage`
reports of the requests they finished. Pure, but for the ratio's one running mean.

The load this measures is what a request holds on its server (its lease's `tokens`): the prompt as
estimated here, plus the tokens generated so far as the relay sees them pass (observe.py).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import orjson

from .kinds import Endpoint

# Characters a token takes before anything is learnt: English text through a Llama-3 or GPT
# tokenizer. Chat templates add a few tokens a message (roles, turn ends).
CHARS_PER_TOKEN = 4.0
TEMPLATE_TOKENS_PER_MESSAGE = 4
# The learnt correction stays within these factors of the first guess: a server whose usage is
# nonsense must not make every estimate zero or unbounded.
MIN_RATIO, MAX_RATIO = 0.25, 4.0
# Weight of each finished request in the running mean of the ratio (about the last 50 requests).
LEARN_WEIGHT = 0.02
# Items of a prompt looked at: past this a body is one of the hostile kind, and its estimate is a floor.
MAX_ITEMS = 100_000


def prompt_estimate(payload: dict[str, Any], endpoint: Endpoint) -> int:
    """The prompt's tokens as first guessed from a request body (at least 1)."""
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
            c, t = _messages(given)
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
    """(characters of text, tokens already counted) of a chat's messages or a Responses input."""
    if not isinstance(messages, list):
        return 0, 0
    chars = 0
    for message in messages[:MAX_ITEMS]:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content[:MAX_ITEMS]:
                if isinstance(part, dict) and isinstance(text := part.get("text"), str):
                    chars += len(text)
        for key in ("arguments", "output"):  # a tool call and its result, sent back in a Responses input
            if isinstance(value := message.get(key), str):
                chars += len(value)
    return chars, TEMPLATE_TOKENS_PER_MESSAGE * min(len(messages), MAX_ITEMS)


def _prompt(prompt: object) -> tuple[int, int]:
    """A completion prompt: a string, a list of strings (a batch), or token ids (counted as such)."""
    if isinstance(prompt, str):
        return len(prompt), 0
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):
            return 0, len(prompt)
        return sum(len(p) if isinstance(p, str) else 0 for p in prompt[:MAX_ITEMS]), 0
    return 0, 0


class TokenRatio:
    """Prompt tokens the servers reported over what was estimated, as a running mean."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 1.0

    def scaled(self, estimate: int) -> int:
        return max(1, round(estimate * self.value))

    def learn(self, estimate: int, reported: int) -> None:
        """A finished request: `estimate` first guessed (unscaled), `reported` by its server's usage."""
        if estimate <= 0 or reported <= 0:
            return
        ratio = min(MAX_RATIO, max(MIN_RATIO, reported / estimate))
        self.value += LEARN_WEIGHT * (ratio - self.value)
