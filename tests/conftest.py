"""Test tiers, the checks every session keeps, and the fixtures that start loopback processes.

Tiers (`pytest -m inprocess`, `-m loopback`, `-m real`; together they are the whole suite):
- inprocess: no child process. Pure units, and the ASGI app driven in the test's own event loop
  against upstream servers running in that loop (tests/inprocess.py). Seconds.
- loopback: starts processes on 127.0.0.1: simulators, the proxy under uvicorn with its edge
  protocol, the load tester, the real openai client against them, promtool/kubectl. Minutes.
- real: llama.cpp's llama-server behind the proxy (tests/gateway/test_real_engine.py).

Each test module gets its tier in MODULE_TIERS below; a test in a mixed module gets its own in
TEST_TIERS, and an explicit `@pytest.mark.<tier>` on a test wins over both. A module missing from
the table fails collection, so a new file cannot slip through untiered.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import hypothesis.configuration
import pytest

from loadtest.procs import Proc, on_free_port, simulator_args, start
from proxy.config import Settings

from .helpers import start_proxy
from .inprocess import StartGateway, gateways

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("inprocess", "loopback", "real")

MODULE_TIERS = {
    "test_ablation": "inprocess",
    "test_adaptive": "inprocess",
    "test_adaptive_stack": "inprocess",
    "test_forecast": "inprocess",
    "test_field": "inprocess",
    "test_field_run": "loopback",
    "test_affinity": "inprocess",
    "test_calibrate": "inprocess",
    "test_calibrate_search": "inprocess",
    "test_quickcal": "inprocess",
    "test_calibration_file": "inprocess",
    "test_classes": "inprocess",
    "test_cli": "inprocess",
    "test_config": "inprocess",
    "test_defaultpolicy": "inprocess",
    # mkdocs builds the site in a process of its own.
    "test_docs": "loopback",
    "test_doctor_judge": "inprocess",
    "test_doctor_real": "real",
    "test_doctor_sim": "loopback",
    "test_edge": "loopback",
    "test_engine_signal": "inprocess",
    "test_engines": "inprocess",
    "test_evidence": "inprocess",
    "test_gateway": "inprocess",
    "test_headtohead": "inprocess",
    "test_headtohead_affinity": "inprocess",
    "test_headtohead_classes": "inprocess",
    "test_headtohead_run": "loopback",
    "test_hostile_config": "inprocess",
    "test_hostile_edge": "loopback",
    "test_hostile_input": "loopback",
    "test_hostile_readings": "inprocess",
    "test_hostile_server": "loopback",
    "test_hostile_upstream": "inprocess",
    "test_kubernetes": "loopback",
    "test_layers": "inprocess",
    "test_loadtest_cli": "loopback",
    "test_loadtest_connections": "loopback",
    "test_loadtest_interrupt": "loopback",
    "test_logs": "inprocess",
    "test_model_stack": "inprocess",
    "test_overhead": "loopback",
    "test_pipeline": "inprocess",
    "test_policy": "inprocess",
    "test_profile": "inprocess",
    "test_priority": "inprocess",
    "test_proxy": "loopback",
    "test_real_engine": "real",
    "test_reliability": "loopback",
    "test_responses": "inprocess",
    "test_scaleout": "inprocess",
    "test_shift": "inprocess",
    "test_simulator_accept": "inprocess",
    "test_simulator_physics": "inprocess",
    "test_steptimes": "inprocess",
    "test_radix": "inprocess",
    "test_simulator_speed": "loopback",
    "test_simulator_wire": "loopback",
    "test_speedmodel": "inprocess",
    "test_sse_relay": "inprocess",
    "test_stack": "loopback",
    "test_stats": "inprocess",
    "test_sweep_commands": "inprocess",
    "test_tally": "inprocess",
    "test_tokens": "inprocess",
    "test_topology": "inprocess",
    "test_topology_stack": "loopback",
    "test_tracing": "inprocess",
    "test_upstream": "inprocess",
    "test_verdicts": "inprocess",
    "test_workload": "inprocess",
}

# Tests that start processes in modules that are otherwise in-process ("module::function").
TEST_TIERS = {
    "test_cli::test_serve_runs_the_gateway_from_its_env_file": "loopback",
    "test_responses::test_openai_sdk_responses_streamed_and_not_and_continued": "loopback",
    "test_responses::test_openai_sdk_responses_errors_and_a_client_that_leaves": "loopback",
    "test_calibration_file::test_save_writes_the_curves_acceptance_settings_and_recommendation": "loopback",
    "test_calibration_file::test_save_measures_each_classs_acceptance": "loopback",
    "test_calibration_file::test_a_server_without_metrics_gives_null_acceptance_and_still_a_file": "loopback",
    "test_calibration_file::test_a_server_without_speculation_gives_null_acceptance": "loopback",
    "test_calibration_file::test_save_into_a_missing_directory_fails_before_measuring": "loopback",
    "test_config::test_bad_setting_exits_non_zero_naming_it": "loopback",
    "test_config::test_bad_calibration_file_exits_2_naming_it": "loopback",
    "test_config::test_missing_or_broken_calibration_file_exits_2": "loopback",
    "test_config::test_passwords_in_server_urls_are_never_printed": "loopback",
    "test_hostile_config::test_overflowing_calibration_exits_2_with_one_line": "loopback",
    "test_hostile_config::test_url_password_with_a_hash_exits_2_with_one_line": "loopback",
    "test_hostile_config::test_a_fifo_is_refused_without_waiting_for_a_writer": "loopback",
    "test_kubernetes::test_secret_env_stays_out_of_git_and_is_required": "loopback",
    "test_scaleout::test_paired_groups_behind_replicas": "loopback",
    "test_scaleout::test_pooled_servers_behind_replicas": "loopback",
    "test_shift::test_adaptive_follows_the_prompt_mix_through_two_shifts": "loopback",
    "test_shift::test_shift_rejects_a_settle_period_as_long_as_the_phase": "loopback",
    "test_simulator_accept::test_chunks_and_live_gauge_follow_the_prompt_mix": "loopback",
    "test_tracing::test_spans_reach_an_otlp_receiver_and_the_last_at_exit": "loopback",
    "test_tracing::test_the_overhead_benchmark_measures_specgate_traced_beside_untraced": "loopback",
    "test_upstream::test_an_https_server_is_reached_over_tls": "loopback",
    "test_workload::test_multiturn_classes_against_the_simulator": "loopback",
    "test_workload::test_sweep_reports_each_class_in_the_table_and_the_json": "loopback",
    "test_workload::test_later_turns_of_a_conversation_report_cached_tokens": "loopback",
}


def pytest_configure(config: pytest.Config) -> None:
    # Before collection: importing a module with @given already writes Hypothesis's caches, into
    # ./.hypothesis unless told otherwise.
    home = tempfile.mkdtemp(prefix="specgate-hypothesis-")
    config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))
    hypothesis.configuration.set_hypothesis_home_dir(home)
    config.stash[_TREE_BEFORE] = _tree_state()
    for tier, what in (
        ("inprocess", "no child process: units, and the ASGI app against upstreams in the test's own loop"),
        ("loopback", "starts processes on 127.0.0.1: simulators, the proxy under uvicorn, tools"),
        ("real", "llama.cpp's llama-server behind the proxy"),
    ):
        config.addinivalue_line("markers", f"{tier}: {what}")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered: set[str] = set()
    for item in items:
        module = item.path.stem
        explicit = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(explicit) > 1:
            raise pytest.UsageError(f"{item.nodeid} has more than one tier: {sorted(explicit)}")
        name = getattr(item, "originalname", item.name)
        tier = next(iter(explicit), None) or TEST_TIERS.get(f"{module}::{name}") or MODULE_TIERS.get(module)
        if tier is None:
            untiered.add(str(item.path.relative_to(ROOT)))
            continue
        if not explicit:
            item.add_marker(getattr(pytest.mark, tier))
    if untiered:
        raise pytest.UsageError(
            f"no test tier for {', '.join(sorted(untiered))}: add the module to MODULE_TIERS in tests/conftest.py"
        )
    # A renamed test would fall back to its module's tier unnoticed.
    modules = {item.path.stem: item.module for item in items if isinstance(item, pytest.Function)}
    stale = [
        k
        for k in TEST_TIERS
        if k.split("::")[0] in modules and not hasattr(modules[k.split("::")[0]], k.split("::")[1])
    ]
    if stale:
        raise pytest.UsageError(f"TEST_TIERS in tests/conftest.py names tests that do not exist: {stale}")


# The settings read `.env` from the working directory. In this process that never happens, even
# for a test that forgets `_env_file=None`: a developer's local `.env` must not steer unit tests.
Settings.model_config["env_file"] = None


@pytest.fixture(autouse=True)
def _tier_is_honest(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process test that starts a process fails; a process started from the repository
    would read a local `.env` (its cwd is this one), so the process tiers refuse to run beside one."""
    if request.node.get_closest_marker("inprocess") is not None:

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"an inprocess test started a process ({args[1] if len(args) > 1 else kwargs}): "
                                 "tier it loopback in tests/conftest.py")  # fmt: skip

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    elif (Path.cwd() / ".env").exists():
        pytest.fail(f"{Path.cwd() / '.env'} would configure the processes this test starts: move it away", False)


def _tree_state() -> set[str] | None:
    """Every changed, untracked or ignored path in the work tree, but for caches tools keep there."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "-z"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    caches = ("__pycache__/", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/", ".venv", ".venv-peers")
    return {entry for entry in out.split("\0") if entry and not any(c in entry for c in caches)}


_TREE_BEFORE = pytest.StashKey[set[str] | None]()


@pytest.fixture(scope="session", autouse=True)
def _nothing_written_into_the_tree(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    before = request.config.stash.get(_TREE_BEFORE, None)
    after = _tree_state()
    if before is not None and after is not None and after - before:
        pytest.fail(f"tests wrote into the work tree: {sorted(after - before)}; write under tmp_path", False)


@pytest.fixture
def anyio_backend() -> str:
    # The proxy runs on asyncio (uvloop in production); in-process tests share that loop.
    return "asyncio"


@pytest.fixture
async def gateway() -> AsyncIterator[StartGateway]:
    """`gw = await gateway(high_watermark=4)`: the app in-process in front of two in-process
    simulators (tests/inprocess.py); needs `pytest.mark.anyio`."""
    async with gateways() as start:
        yield start


@dataclass
class Sim:
    url: str
    port: int
    proc: Proc


StartSim = Callable[..., Sim]


@pytest.fixture
def simulator() -> Iterator[StartSim]:
    """Start a real simulator process: `simulator("speculative", "--time-scale", "10")`."""
    procs: list[Proc] = []

    def start_sim(role: str = "baseline", *args: str, wait_ready: bool = True) -> Sim:
        def launch(port: int) -> Sim:
            url = f"http://127.0.0.1:{port}"
            ready = f"{url}/health" if wait_ready else None
            return Sim(url, port, start(f"simulator-{role}", simulator_args(role, port, *args), ready_url=ready))

        sim = on_free_port(launch)
        procs.append(sim.proc)
        return sim

    yield start_sim
    for proc in procs:
        proc.stop()


@dataclass
class Stack:
    """The proxy under uvicorn in front of two simulator processes, all on loopback."""

    url: str
    spec: Sim
    base: Sim
    proxy: Proc
    env: dict[str, str]


StartStack = Callable[..., Stack]


@pytest.fixture
def stack(simulator: StartSim) -> Iterator[StartStack]:
    """`stack(sim_args=[...], SPECGATE_HIGH_WATERMARK="4")` starts simulators and proxy."""
    procs: list[Proc] = []

    def start_stack(
        sim_args: tuple[str, ...] = ("--time-scale", "20"),
        spec_args: tuple[str, ...] = (),
        base_args: tuple[str, ...] = (),
        **env: str,
    ) -> Stack:
        spec = simulator("speculative", *sim_args, *spec_args)
        base = simulator("baseline", *sim_args, *base_args)
        proxy = start_proxy(spec.url, base.url, **env)
        procs.append(proxy.proc)
        return Stack(proxy.url, spec, base, proxy.proc, proxy.env)

    yield start_stack
    for proc in procs:
        proc.stop()
