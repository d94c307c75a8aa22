"""Prompt sources for the load generator: diverse (seeded), fixed, or a JSONL file."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

_TOPICS = (
    "the history of the printing press",
    "how vaccines train the immune system",
    "writing a binary search in Rust",
    "the causes of the French Revolution",
    "photosynthesis in C4 plants",
    "tax-efficient retirement saving",
    "how TCP congestion control works",
    "a recipe for sourdough bread",
    "the plot of Moby-Dick",
    "quantum entanglement for beginners",
    "designing a REST API for a library",
    "the economics of solar power",
    "training for a first marathon",
    "how transformers compute attention",
    "the geology of Iceland",
    "negotiating a salary offer",
    "SQL window functions with examples",
    "the life cycle of stars",
    "caring for a bonsai tree",
    "the rules of cricket",
    "garbage collection in the JVM",
    "Roman aqueducts",
    "debugging a memory leak in Python",
    "the water cycle",
    "Bach's Goldberg Variations",
)
_TASKS = (
    "Explain {t} in detail.",
    "Write a short essay about {t}.",
    "Give me a step-by-step guide to {t}.",
    "Summarise what an expert should know about {t}.",
    "Teach {t} to a curious teenager.",
    "List common misconceptions about {t} and correct them.",
)
_FILLER = (
    "Please be thorough, give concrete examples, and organise the answer with headings. "
    "Assume the reader is smart but new to the subject, and point out where people usually go wrong. "
)
FIXED_PROMPT = "Explain speculative decoding in large language models."


@dataclass(frozen=True)
class Prompt:
    """One request's input: `messages` for chat, `text` for completions."""

    messages: tuple[dict[str, Any], ...]
    text: str

    def body(self, chat: bool) -> dict[str, Any]:
        return {"messages": list(self.messages)} if chat else {"prompt": self.text}


def _from_text(text: str) -> Prompt:
    return Prompt(({"role": "user", "content": text},), text)


def diverse(seed: int = 0, *, long: bool = True) -> Iterator[Prompt]:
    """Endless, deterministic, varied prompts: topics, tasks and lengths from ~20 to ~600 tokens
    (with `long=False`, the same topics and tasks at ~20 tokens)."""
    rng = random.Random(seed)
    while True:
        text = rng.choice(_TASKS).format(t=rng.choice(_TOPICS))
        # Lengths spread over a log scale, as real prompts are.
        repeats = int(2 ** rng.uniform(0, 5)) - 1
        if long and repeats:
            text += " " + _FILLER * repeats
        yield _from_text(text)


def fixed() -> Iterator[Prompt]:
    prompt = _from_text(FIXED_PROMPT)
    while True:
        yield prompt


def from_jsonl(path: str) -> list[Prompt]:
    """Lines of {"prompt": "..."} or {"messages": [...]} (or a bare JSON string)."""
    prompts = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if isinstance(obj, str):
            prompts.append(_from_text(obj))
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(_from_text(obj["prompt"]))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
            messages = tuple(obj["messages"])
            text = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            prompts.append(Prompt(messages, text))
        else:
            raise ValueError(f'{path}:{n}: expected {{"prompt": ...}} or {{"messages": [...]}}')
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def source(spec: str, seed: int = 0) -> Iterator[Prompt]:
    if spec == "diverse":
        return diverse(seed)
    if spec == "short":
        # For servers on a CPU, where prefilling ~600 tokens takes seconds and would hide decoding.
        return diverse(seed, long=False)
    if spec == "fixed":
        return fixed()
    items = from_jsonl(spec)

    def cycle() -> Iterator[Prompt]:
        while True:
            yield from items

    return cycle()
