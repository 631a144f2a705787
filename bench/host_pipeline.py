"""The host side of a step on the CPU: is backward ever blocked by the gradient path?

Issue 42 asks the host's work to stay off the critical path: backward pushes each block's
gradients and goes on with the next block while the gradient worker consumes them. This
runs the engine's own host pipeline -- its :class:`~megatrain_ds.gradients.sink.GradientSink`,
its ``_consume_gradient``, the stepper (``optimizer/speculative_step.py``) and host AdamW
(``optimizer/host_adamw.py`` over ``optimizer/cpu_adam.py``'s kernel) -- of a real
:class:`~megatrain_ds.MegatrainEngine` on a Llama on the CPU, with instant device events
(the plain CPU runtime), and stands in for the device's backward with a pure-Python busy
loop of ``--block-ms`` per block on the pushing thread: backward's autograd thread holds
the GIL while it recomputes a block. Per step:

0. wait for the previous step's update (``engine.settle_optimizer()``, not timed as the
   step): with clipping it runs behind ``engine.step()`` on the finish worker
   (``optimizer/pipelined_finish.py``) and the next *forward* waits for it block by block,
   which this bench does not run; left in flight, the first push of the next step would wait
   for all of it (``engine._land_gradient`` settles it) and count it as backward blocked;
1. for each block, last first: spin ``--block-ms`` of Python, then push the block's
   gradients (one piece per parameter, in one ``push_block``, as the outbox does);
2. ``engine.optimizer.step()``: the drain, the stepper's finish, the resident refresh.

Reported (medians over ``--steps`` steps after a warm-up step):

- ``step_s``, ``compute_s`` (the busy loops: the device's backward) and the **host
  critical path** ``host_critical_path_s = step_s - compute_s``: what the host adds;
- **backward blocked** ``push_blocked_s``: time the pushing thread spent inside ``push``
  (back-pressure), less the device work it issued there (``device_work_in_push_s``: on the
  CPU it runs inline, on a GPU it is queued; see :class:`InlineDeviceWork`), and its share
  of the step (target after issue 42: under 5%);
- ``finish_s``: ``engine.optimizer.step()``;
- ``update_wait_s``: step 0's wait, the part of the update behind ``step()`` still running
  when the next step begins (what a GPU's next forward has to cover);
- ``speculated_elements``: elements updated during backward, before the norm was known
  (``optimizer/speculative_step.py``), and the journal that allowed it (``journal_bytes``,
  ``journal_extents``: ``[block, start, end)``; ``--speculative-blocks 0`` turns it off);
- the **worker's rate**: gradient elements per second from the first push to the drain
  with nothing between pushes (alone, and with another thread running Python the whole time:
  ``bench/gradient_worker.py``'s ``with_python_busy``), against a plain ``copy_`` of the
  same bytes (the chunk's bf16 gradient into a held buffer) on the calling thread.

Coupling: only ``engine.sink.push_block`` (the ``GradientPort`` interface backward uses),
``engine.optimizer.step()``, ``engine.states`` (each block's flat layout), the plain CPU
runtime and its ``on(stream)`` (timed, see :class:`InlineDeviceWork`); a new gradient path
behind the sink (its consume, the stepper) is measured as it is, with no change here.

    python bench/host_pipeline.py [--hidden 1024 --layers 4 --block-ms 100 --steps 5] [--no-bf16] [--out PATH]

Writes ``bench/results/host_pipeline_<device>.json`` unless ``--out`` (about 30 s with the
defaults on 2 cores). Rerun after a change to the gradient path and compare
``push_blocked_fraction`` and ``host_critical_path_s``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gradient_worker import with_python_busy

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.runtime import stream_check
from megatrain_ds.runtime.device_runtime import DeviceRuntime, Stream

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Settings:
    """The model, the step's configuration and the stand-in for the device's backward."""

    hidden: int = 1024
    intermediate: int = 2816
    layers: int = 4
    vocab: int = 256
    bf16: bool = True
    clipping: float = 1.0
    block_ms: float = 100.0
    """Python busy loop per block on the pushing thread (a block's recompute and backward)."""
    steps: int = 5
    """Measured steps (after one warm-up step)."""
    speculative_blocks: str = "auto"
    """``megatrain.speculative_blocks``: ``"auto"`` or a number of last blocks (``"0"``: none,
    what ``"auto"`` chose at this shape before the journal was sized by extents)."""


@dataclass(frozen=True)
class StepTimes:
    step_s: float
    compute_s: float
    push_blocked_s: float
    """In ``push``, less the device work it issued (:class:`InlineDeviceWork`)."""
    device_work_in_push_s: float
    finish_s: float
    update_wait_s: float
    """Waiting, before the step, for the previous step's update behind ``step()``."""
    speculated_elements: int
    """Elements the stepper updated during backward (``StepReport.speculated``)."""


class InlineDeviceWork:
    """Time the calling threads spend inside ``runtime.on(stream)``.

    On the CPU, work issued to a stream runs at once on the issuing thread (no-op streams);
    on a GPU it is queued and the thread goes on. Subtracted from the time in ``push``, it
    leaves the time a GPU's backward would be blocked: the events are instant. Device work
    issued outside ``runtime.on`` (on the compute stream) still runs inline and counts as
    blocked.
    """

    def __init__(self, engine: MegatrainEngine) -> None:
        self.seconds = 0.0
        self._on = engine.runtime.on
        engine.runtime.on = self.on  # an instance attribute over the method

    @contextlib.contextmanager
    def on(self, stream: Stream) -> Iterator[None]:
        started = time.perf_counter()
        try:
            with self._on(stream):
                yield
        finally:
            self.seconds += time.perf_counter() - started


def build_engine(settings: Settings, accumulation: int = 1) -> MegatrainEngine:
    """A Llama of ``settings`` on a CPU runtime: the plain one (instant events, no
    staging) unless ``MEGATRAIN_STREAM_CHECK=1`` is set."""
    config = transformers.LlamaConfig(
        vocab_size=settings.vocab,
        hidden_size=settings.hidden,
        intermediate_size=settings.intermediate,
        num_hidden_layers=settings.layers,
        num_attention_heads=max(settings.hidden // 64, 1),
        num_key_value_heads=max(settings.hidden // 256, 1),
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": settings.clipping,
        "bf16": {"enabled": settings.bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "megatrain": {"speculative_blocks": _setting(settings.speculative_blocks)},
    }
    return MegatrainEngine(model, parse_engine_config(ds), device=torch.device("cpu"))


def _setting(value: str) -> int | str:
    return int(value) if value.isdigit() else value


def fake_gradients(engine: MegatrainEngine, dtype: torch.dtype) -> list[torch.Tensor]:
    """One flat gradient per state, of global norm 0.5: below the clipping threshold, so
    speculative updates hold, as in a steady step."""
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(state.layout.numel, generator=generator) for state in engine.states]
    norm = torch.stack([g.norm() for g in grads]).norm()
    return [(g * (0.5 / norm)).to(dtype) for g in grads]


def spin(seconds: float) -> None:
    """Run Python (holding the GIL between bytecodes) for ``seconds``."""
    end = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < end:
        count += 1


def push_state(
    engine: MegatrainEngine, index: int, grad: torch.Tensor, device: InlineDeviceWork
) -> tuple[float, float]:
    """Push state ``index``'s gradients, one piece per parameter: seconds blocked in the
    push, and seconds of device work it ran inline."""
    pieces = [(slot.offset, grad[slot.offset : slot.offset + slot.numel]) for slot in engine.states[index].layout.slots]
    device_before = device.seconds
    started = time.perf_counter()
    engine.sink.push_block(index, pieces, True)
    inline = device.seconds - device_before
    return time.perf_counter() - started - inline, inline


def backward_order(num_states: int) -> list[int]:
    """The order backward hands states over: blocks last first, then the resident state
    (the embedding's backward comes last)."""
    return [*reversed(range(num_states - 1)), num_states - 1]


def run_step(engine: MegatrainEngine, grads: list[torch.Tensor], block_s: float, device: InlineDeviceWork) -> StepTimes:
    """One optimizer step: blocks last first, each after ``block_s`` of Python; then the
    resident parameters' gradients (the embedding's backward comes last) and the step."""
    waiting = time.perf_counter()
    # The next forward's waits for the previous update (the bench runs no forward): outside
    # the step, so that backward's pushes measure backward's own back-pressure.
    engine.settle_optimizer()
    started = time.perf_counter()
    blocked = inline = compute = 0.0
    for index in backward_order(len(grads)):
        if index < len(grads) - 1:
            spun = time.perf_counter()
            spin(block_s)
            compute += time.perf_counter() - spun
        waited, ran = push_state(engine, index, grads[index], device)
        blocked, inline = blocked + waited, inline + ran
    finishing = time.perf_counter()
    engine.optimizer.step()
    ended = time.perf_counter()
    speculated = engine.last_step_report.speculated if engine.last_step_report is not None else 0
    return StepTimes(ended - started, compute, blocked, inline, ended - finishing, started - waiting, speculated)


def worker_rate(engine: MegatrainEngine, grads: list[torch.Tensor], device: InlineDeviceWork) -> float:
    """Gradient elements per second from the first push to the drain (the worker has
    consumed every chunk), pushed with nothing in between; the step's end is not timed."""
    engine.settle_optimizer()  # the previous update: not the worker's time
    started = time.perf_counter()
    for index in backward_order(len(grads)):
        push_state(engine, index, grads[index], device)
    engine.sink.drain()
    rate = sum(g.numel() for g in grads) / (time.perf_counter() - started)
    engine.optimizer.step()
    engine.settle_optimizer()  # nothing of this step left running beside what is timed next
    return rate


def copy_rate(grads: list[torch.Tensor]) -> float:
    """Elements per second of a plain ``copy_`` of the same gradients into a held buffer."""
    held = [torch.empty_like(g) for g in grads]
    for target, source in zip(held, grads):  # warm: pages touched
        target.copy_(source)
    started = time.perf_counter()
    for target, source in zip(held, grads):
        target.copy_(source)
    return sum(g.numel() for g in grads) / (time.perf_counter() - started)


def measure(settings: Settings) -> dict:
    """Every figure of the module docstring, for ``settings``."""
    engine = build_engine(settings)
    try:
        grads = fake_gradients(engine, torch.bfloat16 if settings.bf16 else torch.float32)
        device = InlineDeviceWork(engine)
        block_s = settings.block_ms / 1e3
        run_step(engine, grads, block_s, device)  # warm-up: kernels loaded, pages touched
        steps = [run_step(engine, grads, block_s, device) for _ in range(settings.steps)]
        alone = worker_rate(engine, grads, device)
        python_busy = with_python_busy(lambda: worker_rate(engine, grads, device))
        plain_copy = copy_rate(grads)
        num_params = engine.num_params
        journal = engine.stepper.journal
        journal_figures = {
            "journal_bytes": journal.nbytes,
            "journal_extents": [[e.index, e.start, e.end] for e in journal.extents],
        }
    finally:
        engine.destroy()
    median = {field: statistics.median(getattr(s, field) for s in steps) for field in asdict(steps[0])}
    return {
        "params": num_params,
        "step_s": median["step_s"],
        "compute_s": median["compute_s"],
        "host_critical_path_s": median["step_s"] - median["compute_s"],
        "push_blocked_s": median["push_blocked_s"],
        "push_blocked_fraction": median["push_blocked_s"] / median["step_s"],
        "device_work_in_push_s": median["device_work_in_push_s"],
        "finish_s": median["finish_s"],
        "update_wait_s": median["update_wait_s"],
        "speculated_elements": median["speculated_elements"],
        **journal_figures,
        "steps": [asdict(s) for s in steps],
        "worker_elements_per_s": {"alone": alone, "python_busy": python_busy},
        "plain_copy_elements_per_s": plain_copy,
        "worker_vs_copy": alone / plain_copy,
    }


LEDGER_MODEL: dict[str, Any] = {"hidden": 64, "intermediate": 176, "layers": 4, "vocab": 96}
"""A tiny Llama for the host ledger (the race checker runs its real steps: slow per op)."""
LEDGER_CASES = {
    "bf16_clip": (True, 1.0, 1),
    "fp32_clip": (False, 1.0, 1),
    "bf16_clip_accumulation_2": (True, 1.0, 2),
    "bf16_no_clip": (True, 0.0, 1),
}
"""Name: (bf16, gradient clipping, accumulation steps)."""


def ledger_of(bf16: bool, clipping: float, accumulation: int) -> dict:
    """The host ledger (``runtime/host_ledger.py``) of a steady optimizer step of the
    :data:`LEDGER_MODEL` Llama, trained under the race checker, which feeds the ledger."""
    settings = Settings(**LEDGER_MODEL, bf16=bf16, clipping=clipping)
    saved = os.environ.get(stream_check.ENV)
    os.environ[stream_check.ENV] = "1"  # read when the engine creates its runtime
    try:
        engine = build_engine(settings, accumulation)
    finally:
        if saved is None:
            del os.environ[stream_check.ENV]
        else:
            os.environ[stream_check.ENV] = saved
    generator = torch.Generator().manual_seed(0)
    try:
        # The third optimizer step is the steady one: the first speculates on the journal, clipping
        # refutes it, and the journal's copy back is counted with the second (tests/test_host_ledger.py).
        for _ in range(3 * accumulation):
            tokens = torch.randint(0, settings.vocab, (2, 16), generator=generator)
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.step()
        counts, num_params = engine.last_host_ledger, engine.num_params
    finally:
        engine.destroy()
    assert counts is not None  # the checker was on
    return {"params": num_params, "per_param": counts.per_param(num_params), "per_step": counts.as_dict()}


def git_rev() -> str:
    """The checkout's commit, ``-dirty`` with uncommitted changes to tracked files outside
    ``bench/results/`` (where the result itself is written), or "unknown"."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()

    try:
        rev = git("rev-parse", "--short=12", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    except OSError:
        return "unknown"
    return f"{rev}-dirty" if rev and changed else rev or "unknown"


def machine() -> dict:
    return {
        "device": DeviceRuntime.create(torch.device("cpu")).device_name,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


def report(result: dict) -> str:
    rates = result["worker_elements_per_s"]
    return "\n".join(
        [
            f"{result['params'] / 1e6:.1f}M params; medians per step:",
            f"  step {result['step_s'] * 1e3:8.1f} ms   backward compute (Python) {result['compute_s'] * 1e3:8.1f} ms",
            f"  host critical path {result['host_critical_path_s'] * 1e3:8.1f} ms   "
            f"finish (optimizer.step) {result['finish_s'] * 1e3:8.1f} ms",
            f"  update behind step() still running at the next step {result['update_wait_s'] * 1e3:8.1f} ms",
            f"  speculated during backward {result['speculated_elements'] / 1e6:.2f} M elements "
            f"(journal {result['journal_bytes'] / 2**20:.1f} MiB: {result['journal_extents']})",
            f"  backward blocked in push {result['push_blocked_s'] * 1e3:8.1f} ms "
            f"({100 * result['push_blocked_fraction']:.1f}% of the step; target < 5%)",
            f"  worker {rates['alone'] / 1e6:.0f} M elements/s alone, {rates['python_busy'] / 1e6:.0f} M with "
            f"Python running; plain copy {result['plain_copy_elements_per_s'] / 1e6:.0f} M elements/s "
            f"({result['worker_vs_copy']:.2f}x)",
        ]
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    defaults = Settings()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument(
        "--ledger", action=argparse.BooleanOptionalAction, default=True, help="also the host ledger of LEDGER_CASES"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    settings = Settings(**{name: getattr(args, name) for name in asdict(defaults)})
    result = {
        "git_rev": git_rev(),
        "machine": machine(),
        "settings": asdict(settings),
        **measure(settings),
    }
    print(report(result))
    if args.ledger:
        result["host_ledger"] = {"model": LEDGER_MODEL, "cases": {}}
        print(f"host ledger per step, bytes/param (Llama {LEDGER_MODEL}):")
        for case, (bf16, clipping, accumulation) in LEDGER_CASES.items():
            figures = result["host_ledger"]["cases"][case] = ledger_of(bf16, clipping, accumulation)
            per = figures["per_param"]
            print(
                f"  {case:26s} host {per['host_bytes']:5.1f}  copies {per['copy_bytes']:5.1f}  "
                f"total {per['traffic_bytes']:5.1f}   host ops {figures['per_step']['host_ops']}"
            )
    name = re.sub(r"[^A-Za-z0-9]+", "_", result["machine"]["device"]).strip("_")
    out = args.out or REPO / "bench" / "results" / f"host_pipeline_{name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
