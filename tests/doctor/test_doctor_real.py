"""`specgate doctor` on real llama-servers (loadtest/llamacpp.py): a speculative (n-gram) and a
baseline one serving Gemma 3 270M on the CPU. Skips where llama-server is not installed, as
SPECGATE_SKIP_REAL=1 asks, like the other real-engine tests."""

from __future__ import annotations

import os

import pytest

from loadtest.llamacpp import MODEL_ALIAS, LlamaNotInstalled, model_path, pair, server_binary
from proxy.doctor.cli import main

SLOTS, CTX_PER_SLOT = 2, 1024


def test_doctor_reads_engine_model_and_context_of_llama_server(capsys: pytest.CaptureFixture[str]) -> None:
    if os.environ.get("SPECGATE_SKIP_REAL") == "1":
        pytest.skip("SPECGATE_SKIP_REAL=1")
    try:
        server_binary()
        model_path()
    except LlamaNotInstalled as exc:
        pytest.skip(str(exc))
    with pair(slots=SLOTS, ctx_per_slot=CTX_PER_SLOT, threads=1) as p:
        code = main(["--speculative", p.speculative.url, "--baseline", p.baseline.url, "--timeout-s", "120"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("engine:       llamacpp (its /metrics names)") == 2
    assert out.count(f"model:        {MODEL_ALIAS}") == 2
    assert out.count(f"context:      {CTX_PER_SLOT:,} tokens") == 2
    assert out.count(f"KV pool:      {SLOTS * CTX_PER_SLOT:,} tokens") == 2
    # n-gram drafting on a count: the speculative one drafts, the baseline does not.
    assert "speculates:   yes" in out and "speculates:   no" in out, out
