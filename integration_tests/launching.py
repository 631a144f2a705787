"""Running scripts the way users run them: processes of their own, ``accelerate launch``,
shipped configs.

A process of its own is forked from ``tests/fork_server.py``'s server where nothing it
imports reads what its environment changes (that module's docstring: not a DeepSpeed
reference run, for one, though its launcher may be), else fresh: a child of a server that
imported torch, DeepSpeed, transformers and ``megatrain_ds`` is what a fresh interpreter is
once it has imported them.

Each run gets its own rendezvous port (runs may go side by side) and one CPU thread
(two cores shared by parallel runs; and a run and its reference must use the same thread
count for their float sums to agree). DeepSpeed's variables are set explicitly: a
launched process must not depend on what the test process happens to have.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO_ROOT / "tests"))
import fork_server  # noqa: E402  # pyright: ignore[reportMissingImports]  (tests/fork_server.py)

FORKED_RUNS = Path(__file__).with_name("forked_runs.py")
ACCELERATE_CONFIG = REPO_ROOT / "configs" / "accelerate_megatrain.yaml"
TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(port: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DS_ACCELERATOR": "cuda" if torch.cuda.is_available() else "cpu",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "OMP_NUM_THREADS": "1",
        }
    )
    env.pop("MEGATRAIN_DISABLE_HOOK", None)
    env.update(extra)
    return fork_server.with_this_checkout(env)


@dataclass
class Run:
    """One script run in a process of its own, writing into ``output_dir`` (its ``--output-dir``)."""

    name: str
    script: Path
    output_dir: Path
    args: Sequence[str] = ()
    accelerate: bool = True
    """Through ``accelerate launch --config_file`` ``accelerate_config``."""
    accelerate_config: Path = ACCELERATE_CONFIG
    env: dict[str, str] = field(default_factory=dict)
    num_processes: int = 1
    """Data-parallel ranks (``accelerate launch --num_processes``)."""
    launcher: bool = False
    """The script trains nothing itself: it starts the process that does, a new interpreter
    (TRL's CLI, through ``accelerate launch``), as ``accelerate launch`` does for every run."""
    _process: subprocess.Popen[str] | fork_server.ServedProcess | None = None

    @property
    def log_path(self) -> Path:
        return self.output_dir.with_name(self.output_dir.name + ".log")

    def script_args(self) -> list[str]:
        """The script's command line, after the script."""
        return [*self.args, "--output-dir", str(self.output_dir)]

    def script_command(self) -> list[str]:
        """What the interpreter (or the launcher) is given to run."""
        return [str(self.script), *self.script_args()]

    def start(self) -> None:
        port = free_port()
        command = [sys.executable, *self.script_command()]
        if self.accelerate:
            command = [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                str(self.accelerate_config),
                "--main_process_port",
                str(port),
                "--num_processes",
                str(self.num_processes),
                *command[1:],
            ]
        # The Accelerate config names its DeepSpeed JSON relative to the repository root. The
        # process is forked from tests/fork_server.py's server where its imports allow (a
        # launcher's, the reference's too: the processes it starts are new interpreters; a
        # script's without a launcher), else fresh.
        with open(self.log_path, "w", encoding="utf-8") as log:
            self._process = fork_server.popen(
                command,
                cwd=REPO_ROOT,
                env=child_env(port, **self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                launcher=self.accelerate or self.launcher,
            )

    def wait(self) -> None:
        assert self._process is not None
        code = self._process.wait(timeout=TIMEOUT_S)
        if code != 0:
            tail = self.log_path.read_text(encoding="utf-8", errors="replace")[-4000:]
            raise AssertionError(f"run {self.name!r} exited with {code}:\n{tail}")

    def result(self, name: str = "result.json") -> dict[str, Any]:
        return json.loads((self.output_dir / name).read_text(encoding="utf-8"))


@dataclass
class SharedLaunch(Run):
    """``runs`` (one script, launched alike) in one launch: ``forked_runs.py`` imports the
    script once and forks a child per run. Launched as the first run would be (its launcher,
    Accelerate config and environment); each run's results are read from its own
    ``output_dir`` once this has been waited for."""

    runs: Sequence[Run] = ()

    @classmethod
    def of(cls, name: str, runs: Sequence[Run]) -> SharedLaunch:
        first = runs[0]
        launch = ("script", "accelerate", "accelerate_config", "env", "num_processes", "launcher")
        for run in runs:  # a run launched otherwise would not be the run it says it is
            assert all(getattr(run, key) == getattr(first, key) for key in launch), (run.name, first.name)
        fields = {key: getattr(first, key) for key in launch}
        return cls(name, output_dir=first.output_dir.with_name(name), runs=runs, **fields)

    def script_command(self) -> list[str]:
        return [str(FORKED_RUNS), str(self.script), *(shlex.join(run.script_args()) for run in self.runs)]


@contextlib.contextmanager
def launched_once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[Path, bool]]:
    """``(directory, done)`` for a module-scoped fixture's launches, run once per test session:
    pytest-xdist's workers steal single tests, so a module's tests may run on both workers,
    and each would run the fixture's launches (the Trainer clients': 50 s of CPU). The first
    worker gets a directory of its own (``done`` False) and launches into it; the other waits
    for it here (a lock in the session's temporary directory, which the workers share) and
    gets the same directory with ``done`` True: the runs are there to read. A fixture that
    failed leaves ``done`` unset, and the next worker launches anew into its own directory."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: nothing to share
        yield tmp_path_factory.mktemp(name), False
        return
    shared = tmp_path_factory.getbasetemp().parent  # the session's, above each worker's own
    with open(shared / f"{name}.lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes, a failure included
        done = shared / f"{name}.done"
        if done.exists():
            yield Path(done.read_text(encoding="utf-8")), True
            return
        directory = tmp_path_factory.mktemp(name)
        yield directory, False
        done.write_text(str(directory), encoding="utf-8")  # not reached when the launches failed


def run_side_by_side(runs: Sequence[Run]) -> dict[str, Run]:
    for run in runs:
        run.start()
    for run in runs:
        run.wait()
    return {run.name: run for run in runs}


# Below transformers 5.18.0 the Trainer fills a config's "auto" warmup_num_steps with the
# run's warm-up steps as they are, 0 for TRL's SFTConfig defaults (5.18.0 fills max(1, ...));
# DeepSpeed's WarmupLR and WarmupDecayLR refuse 0 from DeepSpeed 0.19.3 on, that is in every
# release this project supports (CONTRIBUTING.md, "Supported versions"). So TRL's defaults
# with the shipped configs' WarmupDecayLR stop before the first step on DeepSpeed's own
# engine as on this one: a transformers-DeepSpeed incompatibility, which a test is skipped
# for only when every one of its runs stopped at exactly that error.
ZERO_WARMUP_REFUSED = "warmup_num_steps must be a positive integer, got 0"


def skip_if_deepspeed_refused_a_zero_warmup(failed_logs: Sequence[str], runs: int) -> None:
    """Skip the test when all ``runs`` failed (``failed_logs``, their logs) at DeepSpeed's
    refusal of the zero warm-up that transformers below 5.18.0 fills in."""
    import transformers
    from packaging.version import Version

    if (
        Version(transformers.__version__) < Version("5.18.0")
        and len(failed_logs) == runs
        and all(ZERO_WARMUP_REFUSED in log for log in failed_logs)
    ):
        pytest.skip(
            f"transformers {transformers.__version__} fills warmup_num_steps with 0, which DeepSpeed refuses: "
            f"{ZERO_WARMUP_REFUSED!r} on both engines (transformers >= 5.18.0 fills at least 1)"
        )


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or every one in a directory (a sharded checkpoint)."""
    import safetensors.torch

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    assert files, f"no safetensors under {path}"
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(safetensors.torch.load_file(file))
    return weights


def assert_same_weights(ours_dir: Path, reference_dir: Path) -> None:
    """Two saved Hugging Face checkpoints hold the same weights to fp32 summation-order
    rounding (relative Frobenius error over all tensors below 1e-5, the losses' tolerance)."""
    ours, reference = load_weights(ours_dir), load_weights(reference_dir)
    assert ours.keys() == reference.keys()
    diff = sum(float(((ours[k].double() - reference[k].double()) ** 2).sum()) for k in ours)
    norm = sum(float((reference[k].double() ** 2).sum()) for k in ours)
    assert math.sqrt(diff / norm) < 1e-5


@torch.no_grad()
def eval_loss_of_saved_model(model_dir: Path, batches: Sequence[torch.Tensor]) -> float:
    """Mean causal-LM loss of ``from_pretrained(model_dir)`` over ``batches`` (plain
    transformers, fp32, CPU): the independent check that the saved model is the trained one."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return sum(float(model(input_ids=batch, labels=batch).loss) for batch in batches) / len(batches)


def assert_zero_lr_kept_weights(lr0_run: Run, trained_run: Run) -> None:
    """The lr=0 run saved exactly its initial weights, bit for bit, while the trained run's
    weights moved (so the first check can fail)."""
    initial = load_weights(lr0_run.output_dir / "initial.safetensors")
    saved = load_weights(lr0_run.output_dir / "model")
    assert initial.keys() == saved.keys()
    for name in initial:
        assert torch.equal(initial[name], saved[name]), name
    trained = load_weights(trained_run.output_dir / "model")
    assert not all(torch.equal(initial[name], trained[name]) for name in initial)
