"""Prompt sources for the load generator: diverse or repetitive (seeded), fixed, or a JSONL file.

`repetitiveness(text)` scores how much a text repeats itself. The simulator derives a request's
acceptance length from it (`--accept-from-prompt`), standing in for what a draft model gets right:
echo, copy and code-edit tasks repeat their own text and accept most drafts, varied text few.
The contract the rest of the project relies on: `diverse` prompts (long and short) score a mean
below 0.2, `repetitive` ones above 0.8.
"""

from __future__ import annotations

import random
import re
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
# Padding of the long diverse prompts: drawn without replacement, so no sentence appears twice in
# one prompt and a prompt scores as varied text (`repetitiveness` near 0), as real prompts do.
_PADDING = (
    "Please be thorough and give concrete examples.",
    "Organise the answer with headings so it is easy to skim.",
    "Assume the reader is smart but new to the subject.",
    "Point out where people usually go wrong.",
    "I am preparing notes for a study group that meets on Thursday evenings.",
    "Keep the tone friendly, yet precise.",
    "If a term needs a definition, define it the first time it appears.",
    "A short summary at the end would help me remember the main points.",
    "My background is in accounting, so analogies from finance land well with me.",
    "Avoid jargon where a plain word does the job.",
    "Where experts disagree, say so and sketch both positions.",
    "Numbers help: include rough figures when you know them.",
    "I will read this on a phone during my commute.",
    "Mention one or two good books for further reading.",
    "Please do not pad the text with generic advice.",
    "Feel free to use a table if it makes a comparison clearer.",
    "Explain why each step matters, not only what to do.",
    "My teacher said this topic trips up most beginners.",
    "A colleague claimed last week that it is much simpler than it looks.",
    "Write as if for an encyclopedia aimed at curious adults.",
    "Start from first principles before moving to the details.",
    "Show a worked example that I can follow with pen and paper.",
    "Historical context is welcome but keep it brief.",
    "I have about twenty minutes to read whatever you write.",
    "Flag anything that changed in the last few years.",
    "Use British spelling throughout, please.",
    "Bullet points are fine for lists of more than three items.",
    "End with three questions I could use to test myself.",
    "I tried reading the official documentation and got lost quickly.",
    "Give the intuition first and the formal version second.",
    "It would be great to know which parts are safe to skip.",
    "Keep each paragraph under a hundred words.",
    "Compare it with something from everyday life.",
    "I learn best from mistakes, so show a wrong approach and then fix it.",
    "Please note any safety issues a novice might overlook.",
    "Cite the kind of source an expert would trust.",
    "Our office debated this over lunch and nobody could settle it.",
    "This is for a presentation to a non-technical audience.",
    "I would rather have depth on two ideas than a survey of ten.",
    "Translate any formulas into words as well.",
    "Suppose I have a free weekend to practise what you describe.",
    "Tell me what a professional in the field would find obvious.",
    "My grandmother asked me about this and I could not answer her.",
    "Highlight the single most important takeaway in bold.",
    "Keep the answer self-contained; I cannot follow links right now.",
    "A timeline would make the sequence of events easier to follow.",
    "Describe a common misconception and why it persists.",
    "Where there are trade-offs, list the costs next to the benefits.",
    "I speak Spanish natively, so keep the sentences short and clear.",
    "Please avoid oversimplifying to the point of being wrong.",
    "Draw a rough diagram in text if that helps.",
    "Imagine you are explaining this over coffee to a friend.",
    "I need to explain it to my manager tomorrow morning.",
    "Give me a mnemonic if a good one exists.",
    "Include an example that goes against intuition.",
    "Say which details matter in practice and which are trivia.",
    "When you use an acronym, spell it out once.",
    "This came up in a podcast and the host seemed unsure.",
    "I am a visual learner; describe pictures I could sketch.",
    "Close with a one-sentence answer for the impatient reader.",
    "Do not assume I know any calculus.",
    "Our book club wants a fair overview before next month's meeting.",
    "Please check your reasoning before you commit to a conclusion.",
    "Relate it to at least one recent news story if possible.",
    "My nephew is writing a school report on this.",
    "Skip the history unless it explains why things work this way.",
    "Offer a rule of thumb that holds in most cases.",
    "Walk through the edge cases separately.",
    "A bit of humour is welcome as long as it stays accurate.",
    "I keep confusing two of the key ideas; untangle them for me.",
    "Give both a beginner version and an advanced version.",
    "I once heard a myth about this from a tour guide.",
    "Please write in the second person.",
    "Keep the vocabulary at the level of a good newspaper.",
    "Estimate how long it takes to become competent at this.",
    "List the tools or materials someone would need.",
    "I prefer prose over bullet points for the main explanation.",
    "Describe what success looks like so I know when I got it right.",
    "Separate facts from opinions clearly.",
    "Point me to the questions experts are still arguing about.",
    "Assume I will try this on my own without supervision.",
    "Mention any regional differences that might surprise me.",
    "Use one running example from beginning to end.",
    "I work night shifts, so practical tips for odd schedules are useful.",
    "Contrast the textbook account with how it works in reality.",
    "Tell me which beginner resources are overrated.",
    "I am sceptical, so convince me with evidence rather than authority.",
    "Please number the steps so I can refer back to them.",
    "Avoid metaphors that break down under scrutiny.",
    "An honest note on the limits of current knowledge would be valuable.",
    "I have a test on this in two weeks.",
    "Describe the smallest experiment that would demonstrate the idea.",
    "Name a few people whose work shaped this area.",
    "Show how the pieces fit together before zooming in.",
    "I am writing a novel and want a character to sound credible on this.",
    "Give a quick checklist I can print out.",
    "Tell me how to recognise a bad explanation of this topic.",
    "I care more about why than how.",
    "Include the cost in money or time where it is relevant.",
    "Keep it suitable for readers of any age.",
    "Outline what to learn next once I understand this.",
    "My first attempt went badly and I want to know why.",
    "Assume a reader who reads carefully but slowly.",
    "Please flag any step where a calculator would help.",
    "Describe how this looked fifty years ago compared with today.",
    "Cover the ethical questions if there are any.",
    "I found two sources that contradict each other on this.",
    "Give an analogy from cooking if one fits naturally.",
    "Let me know which claims you are less certain about.",
    "Write so that a tired reader at midnight can still follow.",
    "I run a small business and wonder whether this affects it.",
    "Explain the vocabulary that insiders use casually.",
    "Point out which popular shortcuts actually work.",
    "My partner thinks the popular view on this is mistaken, and I want to settle the argument fairly.",
    "Structure the answer so that each section builds on the one before it.",
    "Describe the typical career of someone who works on this every day.",
    "If there is a famous failure connected with this, tell its story briefly.",
    "Please keep code samples short and explain every line that is not obvious.",
    "I have a mild fear that this is too advanced for me; reassure me only if that is honest.",
    "What would a sceptical scientist ask first, and how would you answer?",
    "Give the rough order of magnitude of the quantities involved.",
    "Pretend the reader has never seen a textbook on the matter.",
    "Explain how the field measures progress and which benchmarks it trusts.",
    "Add a glossary of five terms at the very end.",
    "Tell me about a surprising connection to another discipline.",
    "Write the introduction so that it hooks a bored teenager.",
    "Describe the most common beginner project and what it teaches.",
    "Include a note on how the answer would change in a developing country.",
    "Please mention the main open-source or public resources available.",
    "Explain what can be measured at home with simple equipment.",
    "I am comparing several explanations and will grade yours on clarity.",
    "Keep the total length reasonable: depth matters more than breadth here.",
    "Tell me how the story might have gone differently with one change.",
    "I work in a hospital, so medical parallels are familiar to me.",
    "Which parts of the usual explanation are simplifications that later need unlearning?",
    "Describe what goes wrong at very large and very small scales.",
    "Put yourself in the shoes of someone teaching this for the first time.",
    "Mention the sort of question an interviewer might ask about it.",
    "Consider the perspective of a critic from outside the field.",
    "Give an example with round numbers so the arithmetic stays easy.",
    "Please separate the settled core from the speculative frontier.",
    "I am colour-blind, so do not rely on colours to distinguish things.",
    "Explain how the idea spread and who resisted it.",
    "I would like a version I can read aloud in about three minutes.",
    "Discuss how weather, climate or season might influence the outcome.",
    "Tell me how to check the claims myself with freely available data.",
    "Offer a thought experiment that makes the central point vivid.",
    "My last teacher rushed through this, leaving gaps I still notice.",
    "Write in a calm voice without exclamation marks.",
    "Spell out the assumptions hidden in the standard account.",
    "Finish with a recommendation for a first small step.",
    "I want to understand it well enough to spot errors in articles.",
    "Note which terms mean something different in everyday speech.",
    "Tell me what a good diagram of this would contain.",
    "Explain how professionals avoid the classic pitfalls.",
    "Let the examples come from different countries and centuries.",
    "Give me a sense of the open problems that students could work on.",
    "Describe how the topic looks from the point of view of a child.",
)
# Padding grows in units of this many characters (the length of the two sentences it once repeated).
_PAD_UNIT_CHARS = 179
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
    """Endless, deterministic, varied prompts: topics, tasks and lengths from ~10 to ~1,400 tokens
    (four bytes a token), ~350 on average; with `long=False`, the same topics and tasks at ~15.
    Long prompts are padded with distinct sentences in a seeded order, none twice in a prompt, so
    they do not repeat themselves (`repetitiveness` ~0)."""
    rng = random.Random(seed)
    # A stream of its own, so topics, tasks and lengths are drawn as they always were.
    pad_rng = random.Random(f"diverse-padding-{seed}")
    while True:
        text = rng.choice(_TASKS).format(t=rng.choice(_TOPICS))
        # Lengths spread over a log scale, as real prompts are.
        repeats = int(2 ** rng.uniform(0, 5)) - 1
        if long and repeats:
            text += " " + _padding(pad_rng, repeats * _PAD_UNIT_CHARS)
        yield _from_text(text)


def _padding(rng: random.Random, chars: int) -> str:
    parts: list[str] = []
    size = 0
    for sentence in rng.sample(_PADDING, len(_PADDING)):
        # Stop at the sentence boundary nearest to `chars`.
        if size + (len(sentence) + 1) / 2 > chars:
            break
        parts.append(sentence)
        size += len(sentence) + 1
    return " ".join(parts)


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
    if spec == "repetitive":
        return repetitive(seed)
    if spec == "fixed":
        return fixed()
    items = from_jsonl(spec)

    def cycle() -> Iterator[Prompt]:
        while True:
            yield from items

    return cycle()


# ---------------------------------------------------------------------------------------------
# Repetitiveness

# n of the word n-grams `repetitiveness` counts: long enough that common phrases of varied text
# ("one of the") rarely recur, short enough that a repeated line of a few words counts.
REPETITION_NGRAM = 4
# Only this much of a text is read: the score stays cheap for any body a server accepts.
REPETITION_MAX_CHARS = 100_000
_WORD = re.compile(r"\w+|[^\w\s]")


def repetitiveness(text: str) -> float:
    """How much `text` repeats itself, in [0, 1]: the share of its word 4-grams that already
    occurred earlier in the same text.

    Words are runs of letters and digits, lower-cased; every other non-space character is a word of
    its own, so code and punctuation count. A text quoted k times scores about (k - 1) / k; varied
    prose about 0; a text of fewer than 5 words 0. Only the first `REPETITION_MAX_CHARS` characters
    are read.
    """
    words = _WORD.findall(text[:REPETITION_MAX_CHARS].lower())
    n = REPETITION_NGRAM
    grams = list(zip(*(words[i:] for i in range(n)), strict=False))
    if len(grams) < 2:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


# ---------------------------------------------------------------------------------------------
# Repetitive prompts: echo, copy and code-edit tasks that quote their own material many times

_ITEMS = (
    "apples", "copper wire", "a blue notebook", "seven candles", "the garden hose", "two lemons",
    "a box of nails", "printer paper", "the red umbrella", "oat milk", "a spare tyre", "batteries",
    "olive oil", "a ball of string", "three envelopes", "the kitchen scale", "rice", "a torch",
    "green tea", "a bicycle pump", "duct tape", "sunflower seeds", "a wooden spoon", "masking tape",
)  # fmt: skip
_NAMES = (
    "total", "count", "buffer", "index", "price", "weight", "offset", "limit", "score", "items",
    "values", "width", "height", "label", "result", "speed", "level", "queue", "delay", "ratio",
)  # fmt: skip
_LOG_EVENTS = (
    "INFO worker-{n} heartbeat ok latency_ms={v}",
    "WARN cache-{n} eviction pressure high free_mb={v}",
    "INFO http-{n} GET /api/items status=200 bytes={v}",
    "ERROR db-{n} connection reset retry_in_s={v}",
    "DEBUG sched-{n} queue depth={v} running=4",
    "INFO auth-{n} token refreshed ttl_s={v}",
)


def _list_material(rng: random.Random) -> str:
    return "\n".join(f"{i}. {item}" for i, item in enumerate(rng.sample(_ITEMS, rng.randint(5, 9)), 1))


def _code_material(rng: random.Random) -> str:
    a, b, c = rng.sample(_NAMES, 3)
    fn = f"update_{rng.choice(_NAMES)}"
    return (
        f"def {fn}({a}, {b}):\n"
        f"    {c} = 0\n"
        f"    for x in {a}:\n"
        f"        if x > {b}:\n"
        f"            {c} += x\n"
        f"    return {c}"
    )


def _log_material(rng: random.Random) -> str:
    events = rng.sample(_LOG_EVENTS, rng.randint(3, 5))
    return "\n".join(e.format(n=rng.randint(1, 9), v=rng.randint(1, 999)) for e in events)


def _prose_material(rng: random.Random) -> str:
    return " ".join(rng.sample(_PADDING, rng.randint(2, 4)))


def repetitive(seed: int = 0) -> Iterator[Prompt]:
    """Endless, deterministic prompts of high acceptance: a list to copy, code to edit, a log to
    echo or a paragraph to repeat, each quoted 8 to 16 times in the prompt (`repetitiveness` ~0.9)."""
    rng = random.Random(seed)
    while True:
        kind = rng.randrange(4)
        k = rng.randint(8, 16)
        if kind == 0:
            material = _list_material(rng)
            head = f"Repeat the following list exactly, {k} times, with a blank line between copies."
            body = "\n\n".join([material] * k)
        elif kind == 1:
            material = _code_material(rng)
            new = rng.choice(_NAMES) + "_new"
            head = f"My file holds this function {k} times. Rename the function to {new} in every copy:"
            body = "\n\n".join([f"```python\n{material}\n```"] * k)
        elif kind == 2:
            material = _log_material(rng)
            head = "Echo this log back verbatim, every line in order; it repeats one block of lines:"
            body = "\n".join([material] * k)
        else:
            material = _prose_material(rng)
            head = f"Copy the paragraph below word for word, {k} times."
            body = "\n\n".join([material] * k)
        yield _from_text(head + "\n\n" + body)


# ---------------------------------------------------------------------------------------------
# Pieces for text of any length (textbank.py)


def vocabulary() -> tuple[str, ...]:
    """The distinct lower-case words of the diverse prompts' topics and padding, in a fixed order."""
    found = dict.fromkeys(w for line in (*_TOPICS, *_PADDING) for w in re.findall(r"[a-z]+", line.lower()))
    return tuple(found)


def material(rng: random.Random) -> str:
    """One piece of what the repetitive prompts quote (a list, a function or a block of log lines)."""
    return rng.choice((_list_material, _code_material, _log_material))(rng)
