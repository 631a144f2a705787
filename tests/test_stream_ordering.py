"""The engine's stream ordering, proved on the CPU by the race checker.

- The engine under ``MEGATRAIN_STREAM_CHECK=1`` runs on virtual streams and the checker
  sees its work (and finds no race) -- one test of each engine path (parity, checkpoints,
  data parallel and the others ``tests/conftest.py``'s ``CHECKED_SUITES`` names) runs under
  it as its ``[checked]`` variant, and every scenario of the mutation test runs under it
  unmutated here.
- The checker bites: every synchronisation call of the engine's modules is removed, one
  at a time, from a copy of the package, and a short run under the checker
  (``tests/stream_race_scenario.py``) must fail with a race. Survivors are listed in
  :data:`EXPECTED_SURVIVORS`, each with the reason the checker cannot see it, and mutants
  that only some runs catch in :data:`TIMING_DEPENDENT`, with the reason.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import fork_server
import pytest
import tiny_models
import torch
from side_by_side import ds_config
from stream_race_scenario import DEVICE_STATE_SCENARIOS, NVME_SCENARIOS, RACE_EXIT, SCENARIOS, SETTLE_SCENARIOS

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.runtime.stream_check import CheckedStream

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatrain_ds"
SCENARIO = Path(__file__).resolve().parent / "stream_race_scenario.py"
DATA_PARALLEL_WORKER = Path(__file__).resolve().parent / "data_parallel_worker.py"

SYNC_CALLS = {"wait_event", "wait_stream", "record_stream", "used_on", "synchronize", "settle_optimizer"}
"""The calls that order work across streams and threads (``used_on`` is ``record_stream``;
``synchronize`` is also the NVMe tier's wait for a transfer of its I/O threads;
``settle_optimizer`` the engine's wait for the update behind ``step()``)."""

NOT_ENGINE = ("runtime/", "cli.py", "planning/host_probe.py")
"""The runtime implements these calls (and its tracing only times things with them);
``megatrain plan --probe`` only times a block with them (``cli.py``), and its copy load
(``planning/host_probe.py``) waits for its own copies only to pace and count them: neither
orders engine work, which the scenarios run, so their mutants would survive unexplained."""

EXPECTED_SURVIVORS: dict[str, str] = {
    "streaming/activation_stash.py:block:oldest.synchronize": (
        "Backpressure, not ordering: the host waits for the oldest outstanding stash copy so "
        "that device memory held for copies stays bounded when the link is slower than "
        "compute. No access depends on it, so there is no race to catch."
    ),
    "gradients/sink.py:_push_direct:oldest.synchronize": (
        "Backpressure, not ordering: a gradient copied straight into the held gradients takes "
        "no staging buffer, so backward waits for the copy num_staging direct chunks back to "
        "keep the device memory of gradients waiting for the link bounded. What reads the "
        "held gradients and the device norm is ordered by drain()'s wait for the last copy."
    ),
    "optimizer/device_states.py:update:stream.wait_event": (
        "The GPU tier's update waits for backward's compute stream. What it orders on a GPU "
        "is the held gradients' zeroing by HeldWrites.settle at step() (a compute-stream kernel "
        "there, host work for the checker) besides backward's reads of the device weights; the "
        "reads come before the last gradient's produced event, which the sink's drain waits "
        "for on the host before the update is issued, so the checker sees them ordered."
    ),
    "optimizer/device_states.py:settle:stream.wait_event": (
        "settle_optimizer()'s wait for the GPU tier's update, for a user's read of the "
        "parameters between step() and the next forward (a compute-stream op on a GPU). The "
        "engine's own readers are ordered without it: state_dict and checkpoints synchronise "
        "the device (quiesce), forward waits per state (wait_on_device, caught), and the next "
        "step's host reads follow the sink's drain (optimizer/device_states.py's Note)."
    ),
    "engine.py:_master_state_dict_hook:self.settle_optimizer": (
        "state_dict()'s wait for the update behind step(). Its reader is the caller's code, "
        "outside the engine: the state dict holds views of the host masters, read after it "
        "returns, where the checker sees no access (save_checkpoint, the engine's own caller, "
        "settles first). Without it a state_dict taken right after step() holds stale values: "
        "tests/test_pipelined_finish.py's state_dict test catches that by its values. It also "
        "undoes the speculative updates of a state dict taken between a step's last backward "
        "and step() (engine.py _withdraw_speculation): without it that state dict holds them, "
        "which tests/test_call_orders.py catches by its values (the checker sees no race: "
        "the update at step() then finishes from the speculation, as with no state dict)."
    ),
    "optimizer/pipelined_finish.py:before_forward:self.synchronize": (
        "Not visible as a race: a training forward through the engine plans the blocks "
        "before the model runs, and the streamer's wait for block 0 takes the resident "
        "state's landing first (it is first in the finish worker's order), refreshing its "
        "device copy before the embedding computes. The hook's wait matters when the model "
        "is called directly (engine.module(...)); there, without it, the embedding reads a "
        "stale device copy that no write races with (the copy's refresh comes later on the "
        "same stream): tests/test_pipelined_finish.py's direct-call parity test catches that "
        "by its values."
    ),
}
"""``"file.py:function:call"`` -> why removing that call is not caught.

A call found redundant is deleted instead, and the Note of its module says what orders
the work without it: ``device_adamw.py``'s host wait for the loads of a staging buffer
(the sink refills staging on the d2h stream, which had already waited for those loads);
the stash pool's wait for a buffer's last reader, and a stashed block's wait for its
whole fragmented weights (``activation_stash.py``: [Note: stash ordering])."""

TIMING_DEPENDENT: dict[str, str] = {
    "state/nvme_window.py:_after_write:written.synchronize": (
        "A read of a block's swap file waits for the write of it queued before (_written). The "
        "checker sees the two transfers unordered only when they run on different I/O threads "
        "(the tier has two, fed from one queue): then removing the wait is caught (the nvme-all "
        "scenario re-reads blocks soon after writing them); when one thread runs both, its own "
        "program order orders them. Which thread takes which transfer is up to timing, so this "
        "mutant is caught in some runs and survives in others."
    ),
}
"""``"file.py:function:call"`` -> why removing that call is caught only in some runs: neither
listed as a survivor nor required to be caught (it still counts towards :data:`MIN_CAUGHT`),
and a run of it that fails without a race is accepted too (the unordered work then really
ran unordered)."""

MIN_CAUGHT = 0.8


@dataclass(frozen=True)
class SyncSite:
    path: Path  # relative to the package
    line: int
    end_line: int
    function: str
    call: str

    @property
    def key(self) -> str:
        return f"{self.path.as_posix()}:{self.function}:{self.call}"

    def __str__(self) -> str:
        return f"{self.path.as_posix()}:{self.line} ({self.function}: {self.call})"


def sync_sites() -> list[SyncSite]:
    """Every statement of the engine's modules that is just one synchronisation call."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.as_posix().startswith(NOT_ENGINE):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr in SYNC_CALLS
            ):
                enclosing = [f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
                function = max(enclosing, key=lambda f: f.lineno).name if enclosing else "<module>"
                sites.append(
                    SyncSite(
                        relative, node.lineno, node.end_lineno or node.lineno, function, ast.unparse(node.value.func)
                    )
                )
    return sites


def mutant_package(site: SyncSite, root: Path) -> Path:
    """A copy of the package under ``root`` with ``site``'s statement replaced by ``pass``."""
    target = root / "megatrain_ds"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    lines = (PACKAGE / site.path).read_text(encoding="utf-8").splitlines(keepends=True)
    first = lines[site.line - 1]
    indent = first[: len(first) - len(first.lstrip())]
    lines[site.line - 1] = f"{indent}pass  # mutant: {site.call}(...) removed\n"
    for index in range(site.line, site.end_line):
        lines[index] = "\n"
    (target / site.path).write_text("".join(lines), encoding="utf-8")
    return root


def _env(package_root: Path) -> dict[str, str]:
    """The scenario's environment, with the package in ``package_root`` first on ``PYTHONPATH``
    (this checkout's as ``fork_server.with_this_checkout`` puts it: the other launches' server
    serves the unmutated run)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
    }
    env.update(MEGATRAIN_STREAM_CHECK="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TRITON_INTERPRET="1")
    if package_root == REPO:
        return fork_server.with_this_checkout(env)
    paths = [str(package_root), str(REPO / "triton_kernels"), env.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def run_under_checker(site: SyncSite | None, root: Path) -> subprocess.CompletedProcess[str]:
    """The scenario that exercises ``site`` (all of them for ``None``) on the package in ``root``."""
    if site is not None and site.path.parts[0] == "distributed":
        # Gradient all-reduce runs only with several ranks; the blocks are gathered from the
        # ranks' windows only with the weights on their NVMe tiers.
        sys.path.insert(0, str(REPO / "integration_tests"))
        from launching import free_port

        (root / "dp_out").mkdir(exist_ok=True)  # a mutant that runs through writes its results
        gathered = ["--nvme", str(root / "swap"), "--nvme-weights"] if site.path.name == "gathered_weights.py" else []

        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(DATA_PARALLEL_WORKER),
            "parity",
            "--out",
            str(root / "dp_out"),
            "--steps",
            "1",
            *gathered,
        ]
    else:
        device_optimizer = site is not None and site.path.name == "device_adamw.py"
        scenarios = ["device-optimizer", "device-optimizer-no-clipping"] if device_optimizer else []
        if site is not None and site.path.name == "device_states.py":
            scenarios = list(DEVICE_STATE_SCENARIOS)  # the GPU tier's events: only its states use them
        elif site is not None and site.call.endswith("settle_optimizer"):
            scenarios = list(SETTLE_SCENARIOS)  # the update behind step(): any one scenario that pipelines it
        elif site is not None and site.path.parts[0] == "state":
            scenarios = list(NVME_SCENARIOS)  # the NVMe tier's handoffs: only its own threads and windows use them
        elif site is not None and not scenarios:
            apart = NVME_SCENARIOS + DEVICE_STATE_SCENARIOS
            scenarios = [name for name in SCENARIOS if name not in apart]  # nor do the others need the tier
        command = [sys.executable, str(SCENARIO), *scenarios]
    if site is None:
        # The package unmutated: forked from tests/fork_server.py's server, which imported it
        # already (a mutant's copy must be imported by a fresh interpreter).
        return fork_server.run(command, env=_env(root), cwd=root, timeout=600)
    return subprocess.run(command, env=_env(root), cwd=root, capture_output=True, text=True, timeout=600)


def _caught(result: subprocess.CompletedProcess[str]) -> bool:
    return result.returncode == RACE_EXIT or "StreamRaceError" in result.stdout + result.stderr


# -- the engine runs on checked streams ------------------------------------------------------


def test_the_engine_runs_on_checked_streams_and_the_checker_sees_its_work(stream_check, cpu_single_thread):
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(num_layers=2), parse_engine_config(ds_config(accumulation=2)))
    try:
        assert isinstance(engine.runtime.h2d_stream, CheckedStream)
        assert not engine.runtime.shares_host_memory  # "device" buffers apart, as on a GPU
        for micro in range(2):
            input_ids = torch.randint(0, tiny_models.VOCAB, (2, 8), generator=torch.Generator().manual_seed(micro))
            engine.backward(engine(input_ids=input_ids, labels=input_ids).loss)
            engine.step()
        checker = engine.runtime.checker
        assert checker.races == [] and checker.num_accesses > 1000
        agents = {agent.name for agent in checker._agents}
        assert {"compute", "h2d", "d2h"} <= agents and any(not agent.is_stream for agent in checker._agents)
    finally:
        engine.destroy()


# -- the checker bites -------------------------------------------------------------------------


def test_the_sites_are_found():
    sites = sync_sites()
    files = {site.path.as_posix() for site in sites}
    assert {
        "streaming/weight_streamer.py",
        "streaming/activation_offload.py",
        "gradients/sink.py",
        "optimizer/device_adamw.py",
        "distributed/gradient_reducer.py",
        "state/nvme_window.py",
    } <= files, files
    assert len(sites) >= 12
    assert set(EXPECTED_SURVIVORS) | set(TIMING_DEPENDENT) <= {site.key for site in sites}, (
        "a listed survivor no longer exists"
    )


def test_the_unmutated_scenarios_run_race_free(tmp_path):
    result = run_under_checker(None, REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no race" in result.stdout


@pytest.mark.mutation
def test_removing_any_one_synchronisation_is_caught(tmp_path):
    sites = sync_sites()

    def judge(index_site: tuple[int, SyncSite]) -> tuple[SyncSite, bool, str]:
        index, site = index_site
        try:
            result = run_under_checker(site, mutant_package(site, tmp_path / f"mutant{index}"))
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"mutant {site} hung: removing the call must leave a race, not a deadlock "
                "(keep other work out of a synchronisation statement)"
            )
        # A timing-dependent mutant the checker missed really ran the unordered transfers
        # concurrently: what follows is undefined, and a failure of the run (seen: DeepSpeed's
        # async I/O op aborting at exit after a read overtook its file's write) is its outcome.
        if not _caught(result) and result.returncode != 0 and site.key not in TIMING_DEPENDENT:
            pytest.fail(f"mutant {site} failed without a race:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
        return site, _caught(result), result.stdout[-400:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(judge, enumerate(sites)))
    survivors = {site.key: str(site) for site, caught, _ in outcomes if not caught}
    caught = len(sites) - len(survivors)
    report = "\n".join(f"{'caught  ' if ok else 'SURVIVED'} {site}" for site, ok, _ in outcomes)
    print(report)
    assert caught / len(sites) >= MIN_CAUGHT, report
    unexplained = set(survivors) - set(EXPECTED_SURVIVORS) - set(TIMING_DEPENDENT)
    assert not unexplained, "survivors without a reason in EXPECTED_SURVIVORS:\n" + report
    now_caught = set(EXPECTED_SURVIVORS) - set(survivors)
    assert not now_caught, f"caught now, remove from EXPECTED_SURVIVORS: {sorted(now_caught)}"
