"""Cache affinity: a conversation's next turn goes where its prefix is cached.

An engine keeps the KV of the prompts it served (SGLang's radix cache, vLLM's prefix caching): the
next turn of a conversation, which resends everything so far plus a new message, skips the prefill
of all that on the server that served the last turn, and pays it in full anywhere else. So each
conversation is remembered by a key, with the server its last turn went to and the tokens that turn
left cached there:

    key = x-session-id if the client sent one,
          else the body's `user` (OpenAI's end-user id),
          else a hash of the prompt's leading part: the system prompt and first user message (chat,
               Responses), the first CHARS characters (completions), each part cut at CHARS

in a bounded LRU table (SPECGATE_AFFINITY_ENTRIES). A turn stays with the server that holds its
cache unless that server's predicted cost exceeds the best alternative's by more than the
re-prefill staying saves. Among a role's servers, where the group has the model policy's fitted
decode step times and a prefill rate P (SPECGATE_PREFILL_TOK_S), the cost is priced in
stream-seconds:

    cost(s) = n * (step_s(B+1) + B * (step_s(B+1) - step_s(B)))     the turn's own decode steps,
                                                                     and what it delays B others by,
              + (B+1) * (t - c) / P                                  and its new tokens' prefill
    stay  iff  (1 - e) * cost(held) <= min over s of  cost(s) + slack * (B_s + 1) * c / P
                                                                     (SPECGATE_AFFINITY_SLACK)

with B a server's streams (GroupLoads.placement_load), step_s(B) its fitted step time holding
them and their tokens (each server's own tokens in flight, the others' at the group's context), n
the turn's decode steps (the group's mean output tokens per response, over the role's acceptance
where it drafts), t its prompt's tokens and c those the held server has cached: a prefill holds up
the turn and the server's B streams for its tokens / P seconds each, the new ones anywhere, the
cached ones again on the alternative (c at most the prompt); e the fit's relative error for the
held server's role (its rms_rel, at most MAX_FIT_ERROR; 0 where the calibration file has none), a
share of the turn's whole cost where it is: a move pays its re-prefill for certain, its saving only
as far as the fit is right. So slack 1 moves a turn where the time it would save the others and
itself is more than the prefill it would cost them, beyond the fit's error, and to the server where
it costs least in all, its re-prefill counted (a server of few streams may cost less than one of
fewer tokens, or the other way). On 1+3 pools at 8k, with the margin, turns moved a run fell from
20 to 12 at 72 sessions and from 30 to 21 at 144, beside the rule by requests in flight 0.95x and
1.70x against 0.86x and 1.44x without it, on the same seeds, the intervals overlapping
(docs/benchmarks/2026-12-06-affinity.md). Elsewhere (no fit, P 0) and between groups, requests in flight stand
for the cost, a thousand cached tokens for one request, or the held server's load within a share of
the best's:

    stay  iff  load(held) - load(best) <= slack * cached_tokens / 1000
           or  load(held) <= balance * load(best)                       (SPECGATE_AFFINITY_BALANCE)

as SGLang's gateway balances only past an absolute and a relative gap: at a full batch a few
requests more slow a stream by little, while every turn moved for them prefills its conversation
again. At 64 sessions a GPU of 1k-token chats slack alone moved turns on every fluctuation; with
balance 1.5 the prefix hit rate is smg's (docs/benchmarks/2026-12-08-field.md).

By default (SPECGATE_AFFINITY_RULE=both) a priced group moves a turn only where both rules would:
to the server the priced rule picks among those the rule by requests in flight would leave the held
one for, and only where the price says the move pays. The price counts stream-seconds, but goodput
counts SLOs, and a move's re-prefill lands on the moved turn's TTFT and the other server's prefill
queue. On 1+3 pools at 8k and 72 sessions (docs/benchmarks/2026-12-07-affinity.md), where the priced rule alone
had 0.90x to 1.02x the goodput of the rule by requests in flight over four sets of 48 runs, this
had 1.04x (and a first version of it, which could move a turn to a busier server, 1.06x on two).

Not the adaptive policy's calibrated curves: measured through a multi-turn sweep, their slope
between levels carries each stream's later prefills too, which the rule counts apart, and at small
batches it reads a stream more as a tenth slower for all. Priced on them, on 1+3 pools at 8k and 72
sessions, affinity moved 20 turns a run against 12 and had 0.86x the goodput of the rule by
requests in flight (loadtest headtohead-affinity, docs/benchmarks/2026-12-06-affinity.md).

Which role serves a turn is the policy's: only between the watermarks, where either role pays, and
only where the roles do not share a GPU, does the held server's role win (proxy/routing/steps/affinity.py).
Pure but for the table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..kinds import Endpoint
from ..lru import Lru
from ..policy.base import SPECULATIVE, PolicyConfig, Role, least_loaded
from ..policy.beliefs import Adaptive
from ..policy.speedmodel import StepModel

# The most of a priced turn's cost taken as the fit's error (stays): a worse fit adds no more margin.
MAX_FIT_ERROR = 0.5
# Characters of a prompt the key is made of: enough for any system prompt to set conversations
# apart, few enough that the hash costs nothing.
CHARS = 4096
# A session id or user longer than this is hashed like a prompt: the table never holds megabytes.
MAX_ID_BYTES = 256

# A response's output tokens until responses say (ServerChoice.out_tokens): chat turns run a few
# hundred, and the rule only weighs one server's cost against another's with it.
DEFAULT_OUT_TOKENS = 256.0
# The weight of one response in ServerChoice.out_tokens' moving average.
OUT_ALPHA = 0.05

# How a turn with a remembered server went: to it, or not, and why not.
Outcome = Literal["hit", "miss", "break_load", "break_mode", "break_down"]
BREAKS: tuple[Outcome, ...] = ("break_load", "break_mode", "break_down")


def conversation_key(session: bytes | None, payload: dict[str, Any], endpoint: Endpoint) -> bytes | None:
    """The key a request's conversation is remembered by, or None when it has none: no text, or no
    generation (an embedding's tokens are cached nowhere a chat turn reads them)."""
    if endpoint == "other":
        return None
    if session:
        return b"s:" + _short(session)
    user = payload.get("user")
    if isinstance(user, str) and user:
        return b"u:" + _short(user.encode("utf-8", "surrogatepass"))
    lead = _leading_parts(payload, endpoint)
    if not lead:
        return None
    # The table is this process's own: Python's hash of the parts (64 bits, salted per process)
    # serves, at a third of a cryptographic hash's cost, and hashing the tuple spares joining them.
    return b"p:%x" % (hash(lead) & 0xFFFFFFFFFFFFFFFF)


def _short(value: bytes) -> bytes:
    return value if len(value) <= MAX_ID_BYTES else hashlib.blake2b(value, digest_size=16).digest()


def _leading_parts(payload: dict[str, Any], endpoint: Endpoint) -> tuple[str, ...]:
    """The parts of a prompt every turn of its conversation starts with (empty: none)."""
    if endpoint == "chat":
        return _lead_of_messages(payload.get("messages"))
    if endpoint == "responses":
        if isinstance(payload.get("previous_response_id"), str):
            # Its input is the conversation's newest part, not its lead: such a turn goes where
            # its stored response is (stored.py), and a key of its input would name no other.
            return ()
        instructions = payload.get("instructions")
        given = payload.get("input")
        head = (instructions[:CHARS],) if isinstance(instructions, str) and instructions else ()
        if isinstance(given, str):
            return (*head, given[:CHARS]) if given else head
        return (*head, *_lead_of_messages(given))
    if endpoint in ("completions", "generate"):
        prompt = payload.get("prompt") if endpoint == "completions" else payload.get("text")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        return (prompt[:CHARS],) if isinstance(prompt, str) and prompt else ()
    return ()


def _lead_of_messages(messages: object) -> tuple[str, ...]:
    """The system messages and the first user message, each role then the first CHARS characters
    of its text: what a conversation's later turns resend first."""
    if not isinstance(messages, list):
        return ()
    parts: list[str] = []
    for message in messages[:8]:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content[:8] if isinstance(p, dict) and isinstance(p.get("text"), str))
        if not isinstance(content, str):
            continue
        role = message.get("role")
        parts.append(role if isinstance(role, str) else "")
        parts.append(content[:CHARS])
        if role not in ("system", "developer"):
            break
    return tuple(parts)


def keep(held_load: float, best_load: float, cached_tokens: int, slack: float, balance: float = 1.0) -> bool:
    """Whether a turn stays on the server holding its cache, by requests in flight (the module's
    rule): within `slack` requests per thousand cached tokens of the best, or within `balance`
    times its load (SPECGATE_AFFINITY_BALANCE; 1: the first alone)."""
    return held_load - best_load <= slack * cached_tokens / 1000 or held_load <= balance * best_load


def turn_cost(
    steps: float, batch: float, step_now: float, step_more: float, new_tokens: float, prefill_tok_s: float
) -> float:
    """Stream-seconds a turn of `steps` decode steps and `new_tokens` to prefill adds on a server
    of `batch` streams whose step takes `step_now` seconds, and `step_more` with the turn (the
    module's cost(s))."""
    decode = steps * (step_more + batch * max(step_more - step_now, 0.0))
    return decode + (batch + 1.0) * max(new_tokens, 0.0) / prefill_tok_s


def stays(held_cost: float, moved: float, fit_error: float) -> bool:
    """Whether a turn stays on the server holding its cache, where it costs `held_cost`, against
    the least `moved` (moved_cost) elsewhere: unless its cost there is higher by more than the
    fit's own error, `fit_error` (its relative residual, at most MAX_FIT_ERROR; the module's rule)."""
    e = min(fit_error, MAX_FIT_ERROR) if fit_error > 0 else 0.0
    return held_cost * (1.0 - e) <= moved


def moved_cost(cost: float, batch: float, cached_tokens: int, prefill_tok_s: float, slack: float) -> float:
    """What a turn costs on a server of `batch` streams that does not hold its cache, `cost` there
    with its new tokens: the `cached_tokens` prefilled again too, holding up the server's streams
    and the turn, weighed by `slack`. The turn stays iff its cost on the server holding its cache
    is at most the least of these over the others (the module's rule)."""
    return cost + slack * (batch + 1.0) * cached_tokens / prefill_tok_s


@dataclass
class Held:
    """Where a conversation's last turn went, and the tokens it left cached there."""

    server: str
    tokens: int


class AffinityTable(Lru[bytes, Held]):
    """Conversation key -> Held, the longest unused forgotten first."""

    __slots__ = ()

    def remember(self, key: bytes, server: str, tokens: int) -> None:
        self.put(key, Held(server, tokens))


class Turns(Protocol):
    """What the rule among a role's servers reads of its group."""

    @property
    def adaptive(self) -> Adaptive | None: ...
    @property
    def speed(self) -> StepModel | None: ...
    @property
    def cfg(self) -> PolicyConfig: ...
    def role_of(self, server: str) -> Role: ...
    def placement_load(self, server: str) -> float: ...
    def ours(self, server: str) -> tuple[int, int]: ...
    def engine_accept(self) -> float | None: ...
    def random(self) -> float: ...


class ServerChoice:
    """The module's rule among a role's servers, for one group: whether a turn moves off the server
    holding its cache, and where to."""

    __slots__ = ("_group", "out_tokens")

    def __init__(self, group: Turns) -> None:
        self._group = group
        # The group's output tokens per response, a moving average (note_output): a turn's decode
        # steps as the rule prices them (turn_cost).
        self.out_tokens = DEFAULT_OUT_TOKENS

    def note_output(self, tokens: int) -> None:
        if tokens > 0:
            self.out_tokens += OUT_ALPHA * (tokens - self.out_tokens)

    def priced(self) -> bool:
        """Whether the rule prices a turn's cost: the group has the model policy's fitted step
        times and a prefill rate, and the rule is not the one by requests in flight alone."""
        g = self._group
        a = g.adaptive
        return a is not None and a.cfg.prefill_tok_s > 0 and g.speed is not None and g.cfg.affinity_rule != "in_flight"

    def rule(self) -> str:
        """The rule in effect (SPECGATE_AFFINITY_RULE where the group can price, else `in_flight`)."""
        return self._group.cfg.affinity_rule if self.priced() else "in_flight"

    def turn_cost(
        self, server: str, prompt_tokens: int, new_tokens: int, batch: float | None = None
    ) -> tuple[float, float]:
        """(the stream-seconds a turn of `prompt_tokens`, `new_tokens` of them not cached, adds on
        `server`, the streams the server holds now): the module's cost(s) at the fitted step times,
        at the server's own tokens (ours, and the others' at the group's context); the group must be
        priced(); `batch`: its placement_load, where the caller has read it."""
        g = self._group
        a, speed = g.adaptive, g.speed
        assert a is not None and speed is not None
        role = g.role_of(server)
        if batch is None:
            batch = g.placement_load(server)
        fit = speed.step(role)
        held = self._tokens_on(server, batch)
        now, more = fit.step_s(max(batch, 1.0), held), fit.step_s(batch + 1.0, held + prompt_tokens)
        per_step = 1.0
        if role == SPECULATIVE:
            per_step = g.engine_accept() or a.estimate.accept_live or speed.accept or 1.0
        steps = self.out_tokens / per_step
        return turn_cost(steps, batch, now, more, new_tokens, a.cfg.prefill_tok_s), batch

    def _tokens_on(self, server: str, batch: float) -> float:
        """The tokens `server` holds with `batch` streams (placement_load): ours, and the others'
        streams at the group's context where the model policy knows it (turn_cost)."""
        count, ours = self._group.ours(server)
        others = batch - count
        speed = self._group.speed
        if speed is None or others <= 0:  # the local signal's always: its load is ours
            return ours
        return ours + others * speed.context

    def move(
        self,
        held: str,
        peers: Sequence[str],
        cached_tokens: int,
        prompt_tokens: int,
        slack: float,
        balance: float = 1.0,
    ) -> tuple[bool, str | None]:
        """Whether a turn whose cache `held` holds moves off it to one of its role's other healthy
        servers `peers` (priced where the group is, else by requests in flight), and where to (None
        where it stays)."""
        g = self._group
        held_load = g.placement_load(held)
        held_tokens = self._tokens_on(held, held_load)
        loads = [(s, g.placement_load(s)) for s in peers]
        if all(held_load <= load and held_tokens <= self._tokens_on(s, load) for s, load in loads):
            # No peer holds fewer streams or tokens (as turn_cost counts them): none costs less,
            # cost(s) rising with both, under either rule. Most turns end here, without pricing.
            return False, None
        if self.priced():
            a, speed = g.adaptive, g.speed
            assert a is not None and speed is not None
            if g.cfg.affinity_rule == "both":
                # Only servers the rule by requests in flight would leave the held one for: fewer
                # requests than it by more than its cache is worth.
                loads = [(s, load) for s, load in loads if not keep(held_load, load, cached_tokens, slack, balance)]
                if not loads:
                    return False, None
            new = max(prompt_tokens - cached_tokens, 0)
            prefill = a.cfg.prefill_tok_s
            held_cost, _ = self.turn_cost(held, prompt_tokens, new, held_load)
            # Where it would cost least elsewhere, its re-prefill there counted.
            moved, best = min(
                (moved_cost(*self.turn_cost(s, prompt_tokens, new, load), cached_tokens, prefill, slack), s)
                for s, load in loads
            )
            if stays(held_cost, moved, speed.step(g.role_of(held)).rms_rel):
                return False, None
            return True, best
        least = min(load for _, load in loads)
        if keep(held_load, least, cached_tokens, slack, balance):
            return False, None
        # The least loaded of the others: a turn that breaks off its server never draws it again.
        return True, least_loaded(loads, g.random())
