"""SPECGATE_POLICY=model end to end, in-process: the app with a calibration file that has a speed
model, in front of two simulators (tests/inprocess.py), its decisions and /routing read back."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from ..inprocess import StartGateway
from .test_adaptive_stack import CALIBRATION, SIM
from .test_speedmodel import MODEL

pytestmark = pytest.mark.anyio

# The model's rule acts at once (no dwell, no probes, no band from a margin, no price on a switch).
FAST = {
    "policy": "model",
    "adaptive_max_step_per_s": 1000,
    "adaptive_min_dwell_s": 0,
    "adaptive_probe_s": 0,
    "adaptive_margin": 0,
    "prefill_tok_s": 0,
}


def calibration_file(tmp_path: Path, model: dict[str, Any] | None) -> str:
    path = tmp_path / "calibration.json"
    path.write_bytes(orjson.dumps({**CALIBRATION, "format": "specgate-calibration/2", "model": model}))
    return str(path)


async def streams_before_the_baseline(start: StartGateway, cal: str, prompt: str, most: int = 16) -> int:
    """Streams held open one after another: how many went to the speculative server before the
    first that went to the baseline."""
    gw = await start(sim=SIM, spec={"accept_length": 3.0}, calibration=cal, **FAST)
    body = {"model": "m", "prompt": prompt, "max_tokens": 4000, "stream": True}
    async with contextlib.AsyncExitStack() as held:
        for n in range(most):
            r = await held.enter_async_context(gw.stream(body))
            if r.headers["x-specgate-backend"] == "baseline":
                routing = await gw.routing()
                assert routing["policy"] == "model" and routing["model"]["watermarks"]["high"] == n
                assert routing["model"]["predictions"]["baseline"]["with_one_more"]["tok_s"] > 0
                return n
    return most


async def test_a_long_context_load_leaves_speculation_at_fewer_streams(gateway: StartGateway, tmp_path: Path) -> None:
    # The fit's speculative step reads more KV a token than it saves (c_s > A*c_b): the crossover
    # falls from about 7.8 streams at 100 tokens a stream to about 4.4 at 4,000.
    cal = calibration_file(tmp_path, MODEL)
    short = await streams_before_the_baseline(gateway, cal, "hi " * 20)
    long = await streams_before_the_baseline(gateway, cal, "lorem ipsum " * 1300)
    assert 6 <= short <= 8, short
    assert 3 <= long <= 5 and long < short, long


async def test_without_a_fit_the_model_policy_is_adaptive(gateway: StartGateway, tmp_path: Path) -> None:
    gw = await gateway(sim=SIM, calibration=calibration_file(tmp_path, None), **FAST)
    r = await gw.routing()
    assert r["policy"] == "model" and "model" not in r
    # The adaptive policy's watermarks from the calibration's curves, as adaptive shows them.
    assert r["watermarks"] == {"high": 20, "low": 15} and r["adaptive"]["calibrated"]


async def test_a_long_list_of_calibrated_prompt_sizes_is_shown_as_a_summary(
    gateway: StartGateway, tmp_path: Path
) -> None:
    sizes = [7] * 399_999 + [9]  # as many as a calibration file's size cap (1 MiB) lets in
    cal = calibration_file(tmp_path, {**MODEL, "prompt_tokens": sizes})
    gw = await gateway(sim=SIM, calibration=cal, **FAST)
    r = await gw.client.get("/routing")
    shown = r.json()["model"]["prompt_tokens_measured"]
    assert shown == {"count": 400_000, "min": 7, "max": 9}
    assert len(r.content) < 100_000  # the list is in no group's section either
