"""Traffic classes: acceptance learnt per class of requests, so that when speculation has room for only
part of the traffic, the classes that gain most from it get it first.

A request's class is named by SPECGATE_CLASS_KEY: `header` (the client's `x-specgate-class`, the
default: no header, no class), `api_key` (a hash of its bearer key, never the key), `user` (the
body's `user`), `model` (the body's `model`), or `none`. Each tracked class keeps, decayed with a
half-life of CLASS_HALF_LIFE_S:

    traffic_c = sum of its requests' weights           (each 1 when it arrived, halving every half-life)
    accept_c  = sum tokens / sum decode steps          (of its streams on a speculative server whose
                                                        engine sends one content event a step)

The classes the calibration file names are tracked from their first request and never displaced;
besides them at most SPECGATE_MAX_CLASSES are. A request of a class not tracked counts as `other`,
and its class is a candidate: at most CANDIDATES_PER_CLASS x SPECGATE_MAX_CLASSES are kept, each
with its traffic decayed alike. A new candidate pushes out the one with the least and inherits its
traffic (space-saving: a class with more than 1/(CANDIDATES_PER_CLASS x SPECGATE_MAX_CLASSES) of
the untracked traffic stays a candidate however many names pass), but only its own traffic counts
for a place: a candidate whose own is more than DISPLACE_RATIO times the least tracked class's
traffic takes that class's place (displaced, its series with it; it may come back as a candidate).
So a name sent once keeps its place only until a class with twice its traffic comes, and never
takes one from a class with a request in the last half-life, however many such names a client sends.
A class the calibration file names (`classes`, what calibrate measured per class) starts, when its
first request arrives, with PRIOR_STEPS decode steps at that acceptance: known from its first
request rather than after its first streams end, so its first conversations start where they will
stay (each later move re-prefills one); a few streams of live evidence outweigh it.
The classes that gain most from speculation are the top half of the traffic, ranked by acceptance:

    gains_c  iff  traffic of the classes above c + traffic_c / 2  <=  total traffic / 2

(of two classes with equal traffic, the better; a class of most of the traffic only if it is the
best). steps/classes.py says where that decides.

The traffic's acceptance, for a rule that decides for all of it (a paired group's mode, which no class
splits; a group's watermarks), is its classes' mix:

    A_mix = sum_c traffic_c * accept_c / sum_c traffic_c      over the classes whose acceptance is known
    share = sum_c traffic_c / (traffic of every class + traffic_none)

traffic_none the requests of no class, decayed alike (counted once a class has been seen). What the
speculative server's engine reports, or a probe reads, is the acceptance of what that server served
last: once the mode left speculation, its last streams, or one probe's conversation, of whichever
class it was (measured on the simulated H200, a pair with classes accepting 1.25 and 3.0: the
engine's gauge read 1.25 after the switch, and the watermarks fell to 0 for good, though
speculation was the better choice for the mix). The classes' figures are each read from their own
streams and are kept while they do not run. learning.Learning.accept_live weighs the two by `share`.
Pure but for the book.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..fleet.adapter import MAX_ACCEPT_LENGTH

ClassKey = Literal["none", "header", "api_key", "user", "model"]
CLASS_KEYS: tuple[ClassKey, ...] = ("none", "header", "api_key", "user", "model")
OTHER = "other"
# Characters of a class name kept (a metric label): longer names are cut, odd characters replaced.
NAME_CHARS = 64
CLASS_HALF_LIFE_S = 300.0
# A candidate takes a tracked class's place once its own traffic is more than this many times that
# class's: two classes of about equal traffic do not trade a place back and forth, each trade losing
# what was learnt of one (and its metric series).
DISPLACE_RATIO = 2.0
# Candidates kept per place: the more, the faster a flood of names must come to push a class with
# steady traffic out of them before its own traffic earns a place; each request of a class not
# tracked walks them once.
CANDIDATES_PER_CLASS = 2
# Decode steps a class needs before its acceptance counts (a few streams' worth).
MIN_STEPS = 32
# Decode steps a calibration's acceptance for a class counts as: enough to count for one half-life
# without live evidence (it decays like the rest), a few streams' worth.
PRIOR_STEPS = 2 * MIN_STEPS
# The ranking is recomputed at most this often: it changes as slowly as traffic does, and walking
# every class on every request would cost more than the rest of the decision.
RANK_EVERY_S = 0.5


def class_of(key: ClassKey, header: bytes | None, payload: dict[str, Any], authorization: bytes) -> str | None:
    """A request's class name under SPECGATE_CLASS_KEY, or None (no class)."""
    if key == "header":
        # Clients that send a name outside ASCII send UTF-8 (a calibration file's names are text).
        return _name(header.decode("utf-8", "replace")) if header else None
    if key == "api_key":
        scheme, _, token = authorization.partition(b" ")
        token = token.strip()
        if token and scheme.lower() == b"bearer":
            return "key-" + hashlib.blake2b(token, digest_size=4).hexdigest()
        return None
    if key in ("user", "model"):
        value = payload.get(key)
        return _name(value) if isinstance(value, str) and value else None
    return None


def _name(value: str) -> str | None:
    value = value[:NAME_CHARS]
    if not (value.isprintable() and '"' not in value and "\\" not in value):  # the usual names skip this
        value = "".join(c if c.isprintable() and c not in '"\\' else "_" for c in value)
    return value.strip() or None


@dataclass
class ClassStats:
    traffic: float = 0.0
    tokens: float = 0.0
    steps: float = 0.0
    at: float = 0.0

    def decay(self, now: float, half_life_s: float) -> None:
        if now > self.at:
            f = 0.5 ** ((now - self.at) / half_life_s)
            self.traffic *= f
            self.tokens *= f
            self.steps *= f
            self.at = now

    @property
    def accept(self) -> float | None:
        return self.tokens / self.steps if self.steps >= MIN_STEPS else None


@dataclass(slots=True)
class Candidate:
    """A class not tracked: its traffic since it became a candidate, and what it inherited from the
    candidate it pushed out (which keeps it among them, never earns it a place: a flood of names
    would pass the same weight on and on)."""

    own: float
    inherited: float
    at: float

    def decay(self, now: float, half_life_s: float) -> None:
        if now > self.at:
            f = 0.5 ** ((now - self.at) / half_life_s)
            self.own *= f
            self.inherited *= f
            self.at = now


class ClassBook:
    """The tracked classes and what is known of each."""

    def __init__(
        self, max_classes: int, half_life_s: float = CLASS_HALF_LIFE_S, priors: Mapping[str, float] | None = None
    ) -> None:
        self.max_classes = max_classes
        self.half_life_s = half_life_s
        # Acceptance by class name, from the calibration file.
        self.priors = dict(priors or {})
        self.stats: dict[str, ClassStats] = {}
        # The classes not tracked that asked last, at most CANDIDATES_PER_CLASS per place.
        self.candidates: dict[str, Candidate] = {}
        # Classes displaced since the last `take_forgotten` (their metric series go with them).
        self._forgotten: list[str] = []
        self._ranked: dict[str, bool] = {}
        self._ranked_at = -math.inf
        # Requests of no class, once a class has been seen (a weight, decayed as a class's).
        self.none = ClassStats()
        self._mix: tuple[float, float] | None = None
        self._mix_at = -math.inf

    def tracked(self, name: str, now: float) -> str:
        """A request of class `name` arrived: the name it is counted under, itself while tracked,
        else `other` unless its traffic earns it a place now."""
        s = self.stats.get(name)
        if s is None:
            if name != OTHER and name not in self.priors and len(self._placed()) >= self.max_classes:
                s = self._admitted(name, now)
                if s is None:
                    name = OTHER
                    s = self.stats.get(name)
            if s is None:
                s = self._add(name, now)
        s.decay(now, self.half_life_s)
        s.traffic += 1.0
        return name

    def _add(self, name: str, now: float) -> ClassStats:
        s = ClassStats(at=now)
        prior = self.priors.get(name) if name != OTHER else None
        if prior is not None:
            s.tokens, s.steps = prior * PRIOR_STEPS, float(PRIOR_STEPS)
        self.stats[name] = s
        return s

    def _placed(self) -> list[str]:
        """The tracked classes that hold one of SPECGATE_MAX_CLASSES' places."""
        return [n for n in self.stats if n != OTHER and n not in self.priors]

    def _admitted(self, name: str, now: float) -> ClassStats | None:
        """A request of `name`, not tracked, with every place taken: counted among the candidates,
        and the class tracked (its traffic moved from `other` to it) if that earns it a place."""
        if self.max_classes <= 0:
            return None
        hl = self.half_life_s
        c = self.candidates.get(name)
        if c is None:
            inherited = 0.0
            if len(self.candidates) >= CANDIDATES_PER_CLASS * self.max_classes:
                for old in self.candidates.values():
                    old.decay(now, hl)
                least = min(self.candidates, key=lambda n: self.candidates[n].own + self.candidates[n].inherited)
                out = self.candidates.pop(least)
                inherited = out.own + out.inherited
            c = self.candidates[name] = Candidate(0.0, inherited, now)
        c.decay(now, hl)
        c.own += 1.0
        for s in self.stats.values():
            s.decay(now, hl)
        gone = min(self._placed(), key=lambda n: self.stats[n].traffic)
        if c.own <= DISPLACE_RATIO * self.stats[gone].traffic:
            return None
        del self.stats[gone], self.candidates[name]
        self._forgotten.append(gone)
        earlier = c.own - 1.0  # this request is counted by the caller
        other = self.stats.get(OTHER)
        if other is not None:
            other.traffic = max(0.0, other.traffic - earlier)
        s = self._add(name, now)
        s.traffic = earlier
        return s

    def named(self, name: str) -> str:
        """The name a request of class `name` that does not count in the mix is counted under (a
        batch one: it never runs on speculation): itself while tracked, else `other`; no entry made."""
        return name if name in self.stats else OTHER

    def unclassed(self, now: float) -> None:
        """A request of no class arrived: counted, once any class is tracked, in the share of the
        traffic the classes' mix stands for."""
        if self.stats:
            self.none.decay(now, self.half_life_s)
            self.none.traffic += 1.0

    def mix(self, now: float) -> tuple[float, float] | None:
        """The traffic's acceptance by its classes (A_mix) and the share of the traffic it stands
        for, as reckoned at most RANK_EVERY_S ago; None while no class's acceptance is known."""
        if now - self._mix_at >= RANK_EVERY_S:
            self._mix, self._mix_at = self._reckon_mix(now), now
        return self._mix

    def _reckon_mix(self, now: float) -> tuple[float, float] | None:
        known, total = self._known(now)
        weight = sum(w for _, w, _ in known)
        if weight <= 0:
            return None
        self.none.decay(now, self.half_life_s)
        return sum(a * w for a, w, _ in known) / weight, weight / (total + self.none.traffic)

    def _known(self, now: float) -> tuple[list[tuple[float, float, str]], float]:
        """The classes with traffic whose acceptance is known, as (acceptance, traffic, name), and
        the traffic of every class, each decayed to `now`."""
        known: list[tuple[float, float, str]] = []
        total = 0.0
        for name, s in self.stats.items():
            s.decay(now, self.half_life_s)
            total += s.traffic
            a = s.accept
            if a is not None and s.traffic > 0:
                known.append((a, s.traffic, name))
        return known, total

    def take_forgotten(self) -> list[str]:
        out, self._forgotten = self._forgotten, []
        return out

    def accept(self, name: str) -> float | None:
        s = self.stats.get(name)
        return None if s is None else s.accept

    def measured(self, name: str, tokens: int, steps: int, now: float) -> None:
        """A stream of the class on a speculative server: `tokens` output in `steps` decode steps
        (figures no server could make, more than MAX_ACCEPT_LENGTH a step, teach nothing: one
        hostile `usage` would hold the class's acceptance for hours)."""
        s = self.stats.get(name)
        if s is not None and 0 < steps <= tokens <= steps * MAX_ACCEPT_LENGTH:
            s.decay(now, self.half_life_s)
            s.tokens += tokens
            s.steps += steps

    def ranked(self, now: float) -> dict[str, bool]:
        """Which tracked classes with a known acceptance gain most: ranked by acceptance, a class
        whose share of the traffic has its middle in the top half (empty: fewer than two known)."""
        known = self._known(now)[0]
        if len(known) < 2:
            return {}
        known.sort(reverse=True)
        half = sum(w for _, w, _ in known) / 2
        out, above = {}, 0.0
        for _, w, name in known:
            out[name] = above + w / 2 <= half
            above += w
        return out

    def gains_most(self, name: str, now: float) -> bool | None:
        """Whether class `name` is among those that gain most from speculation (None: not known),
        as ranked at most RANK_EVERY_S ago."""
        if now - self._ranked_at >= RANK_EVERY_S:
            self._ranked, self._ranked_at = self.ranked(now), now
        return self._ranked.get(name)

    def accepts(self, now: float) -> dict[str, float | None]:
        """Each tracked class's acceptance as of `now` (decayed: None once its evidence faded)."""
        out = {}
        for name, s in self.stats.items():
            s.decay(now, self.half_life_s)
            out[name] = s.accept
        return out

    def describe(self, now: float) -> dict[str, dict[str, Any]]:
        ranks = self.ranked(now)
        out = {}
        for name, s in sorted(self.stats.items()):
            s.decay(now, self.half_life_s)
            a = s.accept
            out[name] = {
                "traffic": round(s.traffic, 3),
                "accept_length": None if a is None else round(a, 3),
                "decode_steps": round(s.steps, 1),
                "calibrated_accept_length": self.priors.get(name) if name != OTHER else None,
                "gains_most": ranks.get(name),
            }
        return out
