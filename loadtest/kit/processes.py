"""A scenario's processes: started together, waited for together, stopped together."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from proxy.policy.calibration import Calibration, Curve, ModelFit, StepFit, load, to_json

from ..calibrate import EXIT_NO_RECOMMENDATION
from ..procs import Proc, free_port, http_status, start
from ..report import write_json
from .command import say

T = TypeVar("T")


class NotReady(RuntimeError):
    """A scenario's process exited, or did not answer, before it was ready."""


# A run whose processes did not all start is started afresh this many times more (fresh_start).
START_RETRIES = 1


def fresh_start(run: Callable[[], T], quiet: bool, retries: int = START_RETRIES) -> T:
    """`run()`, started again on fresh ports where one of its processes did not start: a port that
    free_port found free can be taken by another process before the server binds it, and a run that
    never started measured nothing, so running it again biases nothing."""
    for attempt in range(retries + 1):
        try:
            return run()
        except NotReady as exc:
            if attempt == retries:
                raise
            say(f"    {exc}: starting the run again on fresh ports", quiet)
    raise AssertionError("unreachable")


def wait_ready(pending: Sequence[tuple[Proc, str]], timeout_s: float = 60.0) -> None:
    """Wait until each URL answers 200; the processes start in parallel, so this costs the slowest."""
    deadline = time.monotonic() + timeout_s
    left = list(pending)
    while left:
        for proc, url in list(left):
            if not proc.alive():
                raise NotReady(proc.died("before it was ready"))
            if http_status(url, timeout_s=1.0) == 200:
                left.remove((proc, url))
        if left and time.monotonic() > deadline:
            raise NotReady(f"{', '.join(p.name for p, _ in left)} not ready within {timeout_s:g} s")
        time.sleep(0.05)


@dataclass
class Fleet:
    """Processes started without waiting, then waited for at once (`ready`): starting a kind of
    process costs the slowest of them, not the sum. Stopped in reverse order."""

    procs: list[Proc] = field(default_factory=list)
    pending: list[tuple[Proc, str]] = field(default_factory=list)

    def start(self, name: str, args: Sequence[str], urls: Sequence[str], env: Mapping[str, str] | None = None) -> Proc:
        """Start `python ARGS`; `urls` answer 200 once it is ready."""
        proc = start(name, args, env=dict(env) if env is not None else None)
        self.procs.append(proc)
        self.pending += [(proc, url) for url in urls]
        return proc

    def start_pair(self, name: str, pair_args: Callable[[int, int], Sequence[str]]) -> tuple[str, str]:
        """Start a simulated pair, `pair_args(speculative_port, baseline_port)`, on free ports: the
        speculative server's URL and the baseline's."""
        spec_port, base_port = free_port(), free_port()
        spec, base = f"http://127.0.0.1:{spec_port}", f"http://127.0.0.1:{base_port}"
        self.start(name, pair_args(spec_port, base_port), [spec + "/health", base + "/health"])
        return spec, base

    def start_pool(
        self,
        name: str,
        pair_args: Callable[[int, int], Sequence[str]],
        baseline_args: Callable[[int], Sequence[str]],
        baselines: int,
    ) -> dict[str, str]:
        """A pair (start_pair) and `baselines - 1` more baseline servers, `baseline_args(port)`: the
        URLs by name, `speculative`, then `b0`, `b1`, ..."""
        spec, base = self.start_pair(name, pair_args)
        servers = {"speculative": spec, "b0": base}
        for i in range(1, baselines):
            port = free_port()
            servers[f"b{i}"] = url = f"http://127.0.0.1:{port}"
            self.start(f"{name}-b{i}", baseline_args(port), [url + "/health"])
        return servers

    def start_specgate(self, name: str, env: Callable[[int], Mapping[str, str]]) -> str:
        """Start specgate on a free port with `env(port)` (kit.settings.specgate_env): its URL."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.start(name, ["-m", "proxy"], [url + "/ready"], env(port))
        return url

    def ready(self) -> None:
        pending, self.pending = self.pending, []
        wait_ready(pending)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    @contextlib.contextmanager
    def stopped_on_error(self) -> Iterator[Fleet]:
        """Every process stopped where starting them raises (a process not ready, Ctrl-C): a
        scenario that failed to start leaves nothing running."""
        try:
            yield self
        except BaseException:
            self.stop()
            raise


def calibrate_options(seed: int, max_tokens: int, min_requests: int | None = None) -> list[str]:
    """`loadtest calibrate` arguments that make its sweep send what the scenario will."""
    out = ["--seed", str(seed), "--max-tokens", str(max_tokens)]
    return out if min_requests is None else [*out, "--min-requests", str(min_requests)]


def calibrate_fresh_pair(
    pair_args: Callable[[int, int], list[str]],
    levels: Sequence[int],
    extra: Sequence[str],
    duration_s: float,
    out_dir: Path,
    quiet: bool,
    prompts: str | None = "diverse",
    prompt_tokens: str = "none",
) -> Path:
    """Start a simulated pair (`pair_args(speculative_port, baseline_port)`), run `loadtest calibrate
    --save` on it with `prompts` at `levels`, stop it; the calibration file's path. `extra`: more
    calibrate arguments (seed, tokens, minimum requests; a --workload, with `prompts` None, since
    --prompts is refused beside one); `prompt_tokens`: calibrate's --prompt-tokens, the lengths the
    speed model's fit sweeps (none: no fit). Its output goes to calibration.txt."""

    def started() -> tuple[Fleet, str, str]:
        with (pair := Fleet()).stopped_on_error():
            spec, base = pair.start_pair("simulators-calibration", pair_args)
            pair.ready()
        return pair, spec, base

    pair, spec, base = fresh_start(started, quiet)
    path = out_dir / "calibration.json"
    try:
        args = [
            sys.executable, "-m", "loadtest", "calibrate", "--speculative", spec, "--baseline", base,
            *(["--prompts", prompts] if prompts else []), "--concurrency", ",".join(map(str, levels)),
            "--duration-s", f"{duration_s:g}", *extra, "--save", str(path),
            # Curves over every level asked for: the adaptive and model policies read them whole.
            "--search", "full",
            # Most scenarios route by watermarks, not by the speed model: no sweeps for it.
            "--prompt-tokens", prompt_tokens,
            "--out", str(out_dir / "calibration-sweep.json"), "--quiet",
        ]  # fmt: skip
        what = f"{prompts} prompts" if prompts else "the scenario's workload"
        say(f"calibrating a fresh pair with {what} at {', '.join(map(str, levels))} streams...", quiet)
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        (out_dir / "calibration.txt").write_text(done.stdout + done.stderr)
        if done.returncode == EXIT_NO_RECOMMENDATION:
            # Inconclusive levels left the crossover unknown: a scenario run on made-up watermarks
            # would measure nothing worth reporting.
            raise RuntimeError(
                f"calibrate could not bracket the crossover with conclusive levels, so there are no watermarks to "
                f"run with; see {out_dir / 'calibration.txt'}"
            )
        if done.returncode != 0 or not path.exists():
            raise RuntimeError(f"calibrate failed (exit {done.returncode}); see {out_dir / 'calibration.txt'}")
    finally:
        pair.stop()
    return path


def at_time_scale(path: Path, measured: float, wanted: float, out: Path) -> Path:
    """The calibration at `path`, measured on simulators at time scale `measured`, as it reads on
    simulators at `wanted`, written to `out`. A simulated second lasts 1/T wall seconds, and the
    gateway measures in wall seconds: throughputs scale by wanted / measured, times (TPOT, the
    speed model's step seconds) by measured / wanted; acceptance and watermarks are unitless. A
    learning policy handed a file at another scale reads every server as slower or faster than
    calibrated, but only the roles it has seen, and so compares a corrected role with an
    uncorrected one."""
    cal, k = load(str(path)), wanted / measured

    def curve(c: Curve) -> Curve:
        return dataclasses.replace(
            c, output_tok_s=tuple(x * k for x in c.output_tok_s), mean_tpot_ms=tuple(x / k for x in c.mean_tpot_ms)
        )

    def step(f: StepFit) -> StepFit:
        return dataclasses.replace(f, a=f.a / k, b=f.b / k, c=f.c / k)

    model: ModelFit | None = cal.model
    if model is not None:
        model = dataclasses.replace(model, speculative=step(model.speculative), baseline=step(model.baseline))
    scaled: Calibration = dataclasses.replace(
        cal, speculative=curve(cal.speculative), baseline=curve(cal.baseline), model=model
    )
    write_json(out, to_json(scaled))
    return out
