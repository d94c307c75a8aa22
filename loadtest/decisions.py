"""What specgate's per-request decision costs, in-process: from a request's parsed body to its lease,
for each policy, with and without traffic classes and cache affinity. `python -m loadtest overhead`
prints it beside the hop's cost; `python -m loadtest.decisions` alone.

One decision is what ingress and the relay do for every request before anything is sent upstream:
the prompt's token estimate, the conversation key and the class name (when on), the class book's
and the affinity table's lookups, the client's speculation switch (with classes: the header read and
the classes' defaults, SWITCH_DEFAULTS, so that half the requests ask for on or off), the routing
decision, and the lease taken and released. The
requests are a 10-message chat of a few hundred tokens, 1,000 conversations in 4 classes of known
acceptance (1.3 to 3.0), against a pool of two healthy servers (SPECGATE_TOPOLOGY=pooled, where
classes are routed apart) with 17 requests in flight, the adaptive and model policies starting
from a calibration (the `crossover` profile's curves, and a fit of step times), so that each
class's own watermarks are solved as in service; each figure is the median of `reps` runs of
`n` decisions, timed by the process's CPU clock (what the decision takes from the event loop).
`--baseline-servers N` puts N servers in the baseline role, where a conversation's turn is weighed
against the role's other servers (affinity.py's rule, priced under the model policy).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.config import Settings
from proxy.fleet.servers import servers_of
from proxy.observability.metrics import Metrics
from proxy.policy.base import Role
from proxy.policy.calibration import Calibration, Curve, ModelFit, StepFit
from proxy.routing import switch
from proxy.routing.affinity import AffinityTable, conversation_key
from proxy.routing.classes import ClassBook, class_of
from proxy.routing.fleet import Fleet
from proxy.routing.tokens import TokenRatio, prompt_estimate

from .simulator.profile import load_profile

POLICIES: tuple[str, ...] = ("threshold", "adaptive", "model")
CONVERSATIONS = 1000
CLASSES = ("code", "chat", "agent", "batch-eval")
CLASS_ACCEPT = (3.0, 1.3, 2.2, 1.8)
# SPECGATE_CLASS_SPECULATION with classes on: two of the four classes ask for a side.
SWITCH_DEFAULTS = "code=on,batch-eval=off"
# The calibration the adaptive policy starts from: the `crossover` profile's curves, equal at 20
# streams at acceptance 3; the model policy's fit, step times of an 8B model's shape on one GPU.
PROFILE = "crossover"
NOT_IN_BODY: tuple[bool, None] = (False, None)
CALIBRATED_ACCEPT = 3.0


def _calibration() -> Calibration:
    profile = load_profile(PROFILE)
    n = len(profile.concurrency)
    nan = (float("nan"),) * n
    return Calibration(
        levels=tuple(int(c) for c in profile.concurrency),
        speculative=Curve(profile.speculative_tok_s, nan, (CALIBRATED_ACCEPT,) * n),
        baseline=Curve(profile.baseline_tok_s, nan),
        accept_length=CALIBRATED_ACCEPT,
        high_watermark=19,
        low_watermark=14,
        verdict="crosses",
        model=ModelFit(StepFit(0.008, 1.2e-4, 3e-8), StepFit(0.006, 8e-5, 3e-8), (1000, 4000), 128, CALIBRATED_ACCEPT),
    )


@dataclass(frozen=True)
class DecisionCost:
    policy: str
    classes: bool
    affinity: bool
    # Mean microseconds of CPU (median over repetitions): the decision alone (conversation key,
    # class, lookups, the routing decision) and the whole per-request path (with the prompt's
    # estimate and the lease taken and released).
    decision_us: float
    request_us: float


def _bodies() -> list[dict[str, Any]]:
    system = {"role": "system", "content": "You are a careful assistant for a software team. " * 8}
    out = []
    for c in range(CONVERSATIONS):
        messages: list[dict[str, str]] = [system]
        for turn in range(5):
            messages.append({"role": "user", "content": f"conversation {c} question {turn}: " + "why " * 30})
            messages.append({"role": "assistant", "content": "because " * 40})
        out.append({"model": "m", "messages": messages, "max_tokens": 128})
    return out


def measure(
    policy: str, classes: bool, affinity: bool, n: int = 20_000, reps: int = 5, baselines: int = 1
) -> DecisionCost:
    settings = Settings(
        _env_file=None,
        speculative_url="http://127.0.0.1:1",
        baseline_url=",".join(f"b{i}=http://127.0.0.1:{2 + i}" for i in range(baselines)),
        topology="pooled",
        policy=policy,
        high_watermark=16,
        low_watermark=8,
    )
    topology = settings.routing_topology()
    servers = servers_of(topology)
    for s in servers.values():
        s.health.healthy = True
    cal = _calibration()
    metrics = Metrics(topology.names(), [])
    fleet = Fleet(topology, servers, settings.policy_config(cal), metrics, settings.adaptive_config(), cal)
    defaults = switch.class_defaults(SWITCH_DEFAULTS) if classes else {}
    book = ClassBook(settings.max_classes)
    for name, accept in zip(CLASSES, CLASS_ACCEPT, strict=True):
        book.tracked(name, time.monotonic())
        book.measured(name, round(accept * 1000), 1000, time.monotonic())
    table = AffinityTable(settings.affinity_entries if affinity else 0)
    ratio = TokenRatio()
    bodies = _bodies()
    # Each body's prompt estimate, which the decision is given (the model policy counts it in the
    # group's context); estimating it is timed with the whole request.
    estimates = [ratio.scaled(prompt_estimate(body, "chat")) for body in bodies]
    headers = [name.encode() for name in CLASSES]
    held_open = [fleet.routers[0].admit(Role.BASELINE) for _ in range(17)]

    def decide(i: int, prompt_tokens: int | None = None) -> tuple[Any, bytes | None]:
        body = bodies[i % CONVERSATIONS]
        key = conversation_key(None, body, "chat") if affinity else None
        klass = None
        asked = None
        if classes:
            name = class_of("header", headers[i % len(headers)], body, b"")
            asked = switch.asked(switch.from_header(None), NOT_IN_BODY, name, defaults)[0]
            if name is not None:
                now = time.monotonic()
                tracked = book.tracked(name, now)
                klass = (book.gains_most(tracked, now), book.accept(tracked))
        held = table.get(key) if key is not None else None
        tokens = estimates[i % CONVERSATIONS] if prompt_tokens is None else prompt_tokens
        placed = fleet.decide(can_probe=True, held=held, klass=klass, prompt_tokens=tokens, speculation=asked)
        return placed, key

    def request(i: int) -> None:
        tokens = ratio.scaled(prompt_estimate(bodies[i % CONVERSATIONS], "chat"))
        placed, key = decide(i, tokens)
        backend = placed.decision.backend
        assert backend is not None
        lease = placed.router.admit(backend, placed.server, tokens)
        lease.release()
        if key is not None:
            table.remember(key, lease.server, lease.tokens)

    def timed(step: Callable[[int], object]) -> float:
        runs = []
        for _ in range(reps):
            started = time.process_time_ns()
            for i in range(n):
                step(i)
            runs.append((time.process_time_ns() - started) / n / 1000)
        return statistics.median(runs)

    request_us = timed(request)  # first: it fills the affinity table the decisions then find
    decision_us = timed(decide)
    for lease in held_open:
        lease.release()
    return DecisionCost(policy, classes, affinity, decision_us, request_us)


def run(policies: Sequence[str] = POLICIES, n: int = 20_000, reps: int = 5, baselines: int = 1) -> list[DecisionCost]:
    out = []
    for policy in policies:
        out.append(measure(policy, classes=False, affinity=False, n=n, reps=reps, baselines=baselines))
        out.append(measure(policy, classes=True, affinity=True, n=n, reps=reps, baselines=baselines))
    return out


def report(costs: Sequence[DecisionCost]) -> str:
    lines = [
        "per-request decision, CPU us (median of repetitions): the decision alone / with estimate and lease",
        f"  {'policy':<10} {'plain':>15} {'+classes+affinity+switch':>26}",
    ]
    by_policy: dict[str, dict[bool, DecisionCost]] = {}
    for c in costs:
        by_policy.setdefault(c.policy, {})[c.classes or c.affinity] = c
    for policy, v in by_policy.items():
        cells = []
        for on in (False, True):
            found = v.get(on)
            cells.append("-" if found is None else f"{found.decision_us:6.1f} / {found.request_us:5.1f}")
        lines.append(f"  {policy:<10} {cells[0]:>15} {cells[1]:>26}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.decisions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="decisions per repetition")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--baseline-servers", type=int, default=1, choices=range(1, 9), metavar="N")
    args = parser.parse_args(argv)
    print(report(run(args.policies.split(","), args.n, args.reps, args.baseline_servers)))


if __name__ == "__main__":
    main()
