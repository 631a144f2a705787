"""``scripts/gpu_validate.sh``'s parts that run without a GPU: arguments, the plan, the summary."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_validate.sh"
STEPS = [
    "install",
    "ops",
    "host-contention",
    "gpu-tests",
    "sanitizer",
    "data-parallel",
    "compare",
    "compare-optimizer-cpu",
    "gradient-worker",
    "triton-adamw",
    "timeline",
    "compare-3b",
    "lora-3b",
    "compare-7b",
]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_help_names_every_step_and_option():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    for word in [
        *STEPS,
        "--dry-run",
        "--out",
        "--skip",
        "--only",
        "--limit",
        "--compare-args",
        "TORCH_CUDA_SANITIZER=1",
        "prepare_wheels.sh",
    ]:
        assert word in result.stdout, word


def test_dry_run_plans_every_step_and_writes_the_summary(tmp_path):
    result = run("--dry-run", "--out", str(tmp_path), "--skip", "compare", "--compare-args", "--layers 2")
    assert result.returncode == 0, result.stderr
    planned = [
        line.split(":")[0].removeprefix("[dry-run] ")
        for line in result.stdout.splitlines()
        if line.startswith("[dry-run] ")
    ]
    expected = [step for step in STEPS if step not in ("compare", "data-parallel")]
    if torch.cuda.device_count() > 1:
        expected.insert(3, "data-parallel")
    assert planned == expected
    assert "TORCH_CUDA_SANITIZER=1" in result.stdout and "tests/test_gpu.py" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] is True
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=SCRIPT.parent)
    assert summary["git_rev"].removesuffix("-dirty") == head.stdout.strip()  # the code the steps ran
    results = {row["step"]: row["result"] for row in summary["steps"]}
    assert list(results) == STEPS
    assert results["compare"] == "skipped" and results["gpu-tests"] == "planned"
    # The table printed at the end says the same.
    table = result.stdout.split("step ", 1)[1]
    for step, outcome in results.items():
        assert any(line.split()[:2] == [step, outcome] for line in table.splitlines()), (step, table)


def _planned(stdout: str) -> list[str]:
    return [
        line.split(":")[0].removeprefix("[dry-run] ") for line in stdout.splitlines() if line.startswith("[dry-run] ")
    ]


def test_only_runs_the_steps_it_names_whatever_steps_exist(tmp_path):
    """A lease's call names what it runs: a step added to the script later (as ``lora-3b``
    was after the fourth GPU run's calls were written) stays out of it; ``--skip`` still wins."""
    result = run(
        "--dry-run",
        "--out",
        str(tmp_path),
        "--only",
        "install",
        "--only",
        "ops",
        "--only",
        "gpu-tests",
        "--only",
        "compare-3b",
        "--skip",
        "compare-3b",
    )
    assert result.returncode == 0, result.stderr
    assert _planned(result.stdout) == ["install", "ops", "gpu-tests"]
    notes = {
        row["step"]: (row["result"], row["note"])
        for row in json.loads((tmp_path / "summary.json").read_text())["steps"]
    }
    assert notes["lora-3b"] == ("skipped", "not in --only") and notes["compare-3b"] == ("skipped", "--skip")
    assert [step for step in STEPS if notes[step][0] == "planned"] == ["install", "ops", "gpu-tests"]


def test_each_step_has_a_limit_that_limit_overrides(tmp_path):
    result = run("--dry-run", "--out", str(tmp_path), "--limit", "gpu-tests=150", "--limit", "timeline=30")
    assert result.returncode == 0, result.stderr
    limits = {
        line.split(":")[0].removeprefix("[dry-run] "): line.split("(at most ")[1].split(" s)")[0]
        for line in result.stdout.splitlines()
        if line.startswith("[dry-run] ")
    }
    assert limits["gpu-tests"] == "150" and limits["timeline"] == "30"
    assert limits["install"] == "120" and limits["compare"] == "900", "the others keep their defaults"


def test_a_dry_run_without_out_leaves_the_repository_alone():
    before = set((SCRIPT.parents[1] / "bench" / "results").iterdir())
    assert run("--dry-run").returncode == 0
    assert set((SCRIPT.parents[1] / "bench" / "results").iterdir()) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--skip", "nope"], "unknown step 'nope'"),
        (["--only", "nope"], "unknown step 'nope'"),
        (["--only"], "--only needs a step name"),
        (["--out"], "--out needs a directory"),
        (["--frobnicate"], "unknown argument '--frobnicate'"),
        (["--limit", "compare"], "--limit needs STEP=SECONDS"),
        (["--limit", "nope=5"], "unknown step 'nope'"),
    ],
)
def test_bad_arguments_are_named(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_to_run_and_says_why():
    result = run()
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "--dry-run" in result.stderr
