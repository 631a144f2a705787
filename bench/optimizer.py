"""Host AdamW throughput: the engine's CPU path against torch and DeepSpeed, side by side.

Each implementation updates the same number of fp32 parameters; throughput is counted in
bytes of optimizer state *touched* per second, 28 bytes per element:

    read p, g, m, v (4 + 4 + 4 + 4) + write p, m, v (4 + 4 + 4)          fp32 gradient
    read p, g, m, v (4 + 2 + 4 + 4) + write p, m, v, shadow (12 + 2)     bf16 gradient + bf16 shadow

and set against the host memcpy bandwidth measured in the same run (``copy_`` of a large
fp32 buffer, read + written bytes, the STREAM convention). Rows:

  memcpy                  torch ``copy_``, the yardstick
  engine fp32             the engine's ``HostAdamW.update_range`` with its CPU kernel ("auto"):
                          fp32 gradient, scale 1, no shadow: the same work as the next three rows
  torch AdamW foreach     ``torch.optim.AdamW(foreach=True).step()`` on one parameter
  torch AdamW fused       ``torch.optim.AdamW(fused=True).step()`` (ATen's fused kernel)
  DeepSpeedCPUAdam        ``deepspeed.ops.adam.DeepSpeedCPUAdam.step()`` on one parameter
  engine fp32 clipped     fp32 gradient times a clipping scale (more work: the scaling)
  engine bf16+shadow      the engine's layout in bf16 compute: bf16 gradient, bf16 shadow written
                          (more work than DeepSpeedCPUAdam: widening and the shadow)
  engine bf16 clipped     bf16+shadow with a clipping scale
  engine journaled        bf16+shadow while journaling (a speculative step: optimizer/speculative_step.py)
  DeepSpeedCPUAdam A/A    a second DeepSpeedCPUAdam: the control, whose ratio to the first
                          shows how far a ratio of identical work strays from 1 in the run
  engine kernel=K         the engine path with each other CPU kernel (torch_fused, torch)
  engine fp32 [host_empty]      the engine fp32 update on state allocated as the engine allocates
  DeepSpeedCPUAdam [own state]  and DeepSpeedCPUAdam with the moments it allocates itself

A fair comparison: every row but the two [bracketed] ones updates the *same* p, m, v and
gradient buffers (optimizer states pre-filled with them), so the rows differ only in the
code that runs, not in where their arrays lie. Where they lie matters: arrays of exactly
2^25 fp32 elements allocated back to back sit 128 MiB + 4 KiB apart, element i of each in
the same DRAM bank, and every kernel ran 10-15% slower on them than on the same arrays
8 KiB further apart (no difference at 30M or 24M elements) -- which is why the earlier
runs of this benchmark, with their own buffers per row at 2^25 elements, put the engine
anywhere between 0.88x and 1.12x DeepSpeedCPUAdam. The default size is therefore not a
power of two. The rows run round after round, in a new (seeded) order every round, since a
row pays for the dirty cache lines its predecessor leaves; each row reports its median,
and engine/DeepSpeed is also given as the median of the per-round ratios (both measured
within one round, under the same load), next to the same ratio between two identical
DeepSpeedCPUAdam rows (the A/A control). The load average before and after is recorded.

The main AdamW rows then run again beside one busy-looping process: the engine's own
situation (its gradient worker updates while the main thread runs backward) and that of
any shared machine. DeepSpeed's op splits a range into one fixed share per thread, so a
thread that shares its core holds up the whole update; the engine's threads take blocks
as they go ([Note: one pass over DeepSpeed's kernel] in ``megatrain_ds/optimizer/cpu_adam.py``).

It also measures what each kernel costs the *training* thread when it runs on the engine's
gradient worker: a main-thread loop of small torch ops (like backward's Python) timed
alone and while a worker thread updates back to back, for each engine kernel and for
``DeepSpeedCPUAdam`` through DeepSpeed's own binding, which holds the GIL ([Note: the GIL
and DeepSpeed's op] in ``megatrain_ds/optimizer/cpu_adam.py``). On a machine with few cores the
ratio also contains plain CPU contention (the worker's threads use every core).

Usage:  python bench/optimizer.py [--elements 30000000] [--rounds 15] [--contended-rounds 9]
                                 [--skip-gil] [--output PATH]
Writes bench/results/optimizer_<cpu>.json unless --output says otherwise. DeepSpeed's op
JIT-compiles on first use (25-110 s, cached in ~/.cache/torch_extensions); so does the
engine's build of DeepSpeed's kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

for _key, _value in {
    "DS_ACCELERATOR": "cpu",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29537",
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
}.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402

from megatrain_ds.optimizer.cpu_adam import CPU_KERNELS, make_cpu_kernel  # noqa: E402
from megatrain_ds.optimizer.host_adamw import HostAdamW  # noqa: E402
from megatrain_ds.optimizer.journal import Journal, JournalExtent  # noqa: E402
from megatrain_ds.runtime.device_runtime import DeviceRuntime  # noqa: E402
from megatrain_ds.state.flat_layout import build_flat_layout  # noqa: E402
from megatrain_ds.state.host_store import HostFlatState  # noqa: E402
from megatrain_ds.state.state_placement import whole_in_host_memory  # noqa: E402

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
BYTES_PER_ELEMENT = 28


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class Buffers:
    """One AdamW state and its gradients, shared by every row (see the module docstring)."""

    p: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor  # fp32
    grad_bf16: torch.Tensor
    shadow: torch.Tensor  # bf16

    @classmethod
    def allocate(cls, n: int, empty: Callable[[int, torch.dtype], torch.Tensor] | None = None) -> Buffers:
        """Random p and gradients, zero moments, from ``empty(numel, dtype)`` (torch's by default)."""
        empty = empty or (lambda numel, dtype: torch.empty(numel, dtype=dtype))
        p, grad = empty(n, torch.float32).normal_(), empty(n, torch.float32).normal_()
        return cls(
            p=p,
            m=empty(n, torch.float32).zero_(),
            v=empty(n, torch.float32).zero_(),
            grad=grad,
            grad_bf16=empty(n, torch.bfloat16).copy_(grad),
            shadow=empty(n, torch.bfloat16),
        )


def _engine_numel(n: int) -> int:
    """``n`` rounded up to what a one-parameter flat layout holds (its alignment padding)."""
    return build_flat_layout([("w", torch.Size([n]), 0)]).numel


class _Counter:
    def __init__(self) -> None:
        self.step = 0

    def __call__(self) -> int:
        self.step += 1
        return self.step


def _engine_update(
    buffers: Buffers,
    kernel_name: str,
    grad_dtype: torch.dtype,
    shadow: bool,
    journaled: bool = False,
    grad_scale: float = 1.0,
) -> Callable[[], None]:
    kernel = make_cpu_kernel(kernel_name)
    adamw = HostAdamW([dict(HYPER, params=[])], decoupled=True, cpu=kernel)
    n = buffers.p.numel()
    state = HostFlatState(
        layout=build_flat_layout([("w", torch.Size([n]), 0)]),
        master=buffers.p,
        shadow=buffers.shadow if shadow else None,
        exp_avg=buffers.m,
        exp_avg_sq=buffers.v,
        placement=whole_in_host_memory(n, 4, buffers.shadow.element_size() if shadow else 0),
    )
    assert state.layout.numel == n, "allocate the buffers with _engine_numel(n) elements"
    grad = buffers.grad if grad_dtype == torch.float32 else buffers.grad_bf16
    journal = Journal([state], [JournalExtent(0, 0, n)]) if journaled else None
    counter = _Counter()

    def run() -> None:
        save = None if journal is None else (lambda start, end: journal.save(0, start, end))
        adamw.update_range(state, 0, grad, step=counter(), grad_scale=grad_scale, before_chunk=save)
        if journal is not None:
            journal.clear()

    return run


def _torch_adamw(buffers: Buffers, **implementation: bool) -> Callable[[], None]:
    param = torch.nn.Parameter(buffers.p)  # shares the storage
    param.grad = buffers.grad
    optimizer = torch.optim.AdamW([param], **implementation, **HYPER)
    optimizer.state[param] = {"step": torch.tensor(0.0), "exp_avg": buffers.m, "exp_avg_sq": buffers.v}
    return optimizer.step


def _deepspeed_cpu_adam(buffers: Buffers, own_state: bool = False) -> Callable[[], None]:
    """``own_state``: Adam's moments allocated by DeepSpeedCPUAdam itself (``zeros_like``)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(buffers.p)
    param.grad = buffers.grad
    optimizer = DeepSpeedCPUAdam([param], adamw_mode=True, **HYPER)
    if not own_state:
        optimizer.state[param] = {"step": 0, "exp_avg": buffers.m, "exp_avg_sq": buffers.v}
    return optimizer.step


def _memcpy(n: int) -> Callable[[], None]:
    src, dst = torch.randn(n), torch.empty(n)
    return lambda: dst.copy_(src)


def _gil_probe(iterations: int = 3000) -> float:
    """Seconds for a main-thread loop of small torch ops: Python between GIL-releasing ops,
    as in backward's hooks and autograd Functions (16x16: below torch's parallel grain, so
    the probe itself starts no thread team)."""
    a = torch.randn(16, 16)
    start = time.perf_counter()
    for _ in range(iterations):
        (a @ a).relu_().sum()
    return time.perf_counter() - start


def _gil_interference(update: Callable[[], None], repeats: int = 3) -> float:
    """Median over ``repeats`` of (probe time with ``update`` looping on a worker thread) /
    (probe time alone, measured right before)."""
    ratios = []
    for _ in range(repeats):
        alone = _gil_probe()
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                update()

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        time.sleep(0.05)
        try:
            ratios.append(_gil_probe() / alone)
        finally:
            stop.set()
            thread.join()
    return statistics.median(ratios)


def _measure(runs: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each run, ``rounds`` times, in a new order every round: a row
    pays for the dirty cache lines its predecessor leaves behind (up to the L3's 32 MiB to
    write back), and a fixed or merely rotated order would give every row the same one."""
    names = list(runs)
    order = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _paired(times: dict[str, list[float]], reference: str, name: str) -> float:
    """Median over rounds of ``reference``'s time / ``name``'s time in the same round."""
    return statistics.median(r / t for r, t in zip(times[reference], times[name]))


def _contended(runs: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """:func:`_measure` while one busy-looping process competes for the cores: the engine's
    situation, where the update runs on the gradient worker while the main thread runs
    backward (and any machine shared with other jobs)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        return _measure(runs, rounds)
    finally:
        busy.kill()
        busy.wait()


CONTENDED_ROWS = (
    "DeepSpeedCPUAdam",
    "engine fp32",
    "engine fp32 clipped",
    "engine bf16+shadow",
    "engine bf16 clipped",
    "torch AdamW fused",
    "DeepSpeedCPUAdam A/A",
)
Candidate = tuple[str, Callable[[], Callable[[], None]], int]
"""(row name, builder of its update, bytes per element)"""


def _candidates(n: int, buffers: Buffers) -> list[Candidate]:
    clip = 0.5
    runtime = DeviceRuntime.create(torch.device("cpu"), pin_memory=False)
    rows: list[Candidate] = [
        ("memcpy", lambda: _memcpy(n), 8),
        ("engine fp32", lambda: _engine_update(buffers, "auto", torch.float32, False), BYTES_PER_ELEMENT),
        ("torch AdamW foreach", lambda: _torch_adamw(buffers, foreach=True), BYTES_PER_ELEMENT),
        ("torch AdamW fused", lambda: _torch_adamw(buffers, fused=True), BYTES_PER_ELEMENT),
        ("DeepSpeedCPUAdam", lambda: _deepspeed_cpu_adam(buffers), BYTES_PER_ELEMENT),
        (
            "engine fp32 clipped",
            lambda: _engine_update(buffers, "auto", torch.float32, False, grad_scale=clip),
            BYTES_PER_ELEMENT,
        ),
        ("engine bf16+shadow", lambda: _engine_update(buffers, "auto", torch.bfloat16, True), BYTES_PER_ELEMENT),
        (
            "engine bf16 clipped",
            lambda: _engine_update(buffers, "auto", torch.bfloat16, True, grad_scale=clip),
            BYTES_PER_ELEMENT,
        ),
        ("engine journaled", lambda: _engine_update(buffers, "auto", torch.bfloat16, True, True), BYTES_PER_ELEMENT),
        ("DeepSpeedCPUAdam A/A", lambda: _deepspeed_cpu_adam(buffers), BYTES_PER_ELEMENT),
        # As each system allocates its state (own buffers, so page placement differs between rows):
        (
            "engine fp32 [host_empty]",
            lambda: _engine_update(Buffers.allocate(n, runtime.host_empty), "auto", torch.float32, False),
            BYTES_PER_ELEMENT,
        ),
        (
            "DeepSpeedCPUAdam [own state]",
            lambda: _deepspeed_cpu_adam(Buffers.allocate(n), own_state=True),
            BYTES_PER_ELEMENT,
        ),
    ]
    auto_kernel = make_cpu_kernel("auto").name
    for name in CPU_KERNELS:
        if name != auto_kernel:
            rows.append(
                (
                    f"engine kernel={name}",
                    lambda name=name: _engine_update(buffers, name, torch.float32, False),
                    BYTES_PER_ELEMENT,
                )
            )
    return rows


def _build(candidates: list[Candidate], rows: dict[str, dict]) -> tuple[dict[str, Callable[[], None]], dict[str, int]]:
    """Each candidate's update, warmed up once; an unavailable one gets an error row."""
    runs: dict[str, Callable[[], None]] = {}
    bytes_per_element: dict[str, int] = {}
    for name, build, nbytes in candidates:
        try:
            run = build()
            run()  # warm-up: JIT, thread pools, optimizer state
        except Exception as error:  # e.g. DeepSpeed's op fails to build here
            rows[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{name}: unavailable ({error})")
            continue
        runs[name], bytes_per_element[name] = run, nbytes
    return runs, bytes_per_element


def _print_rows(
    n: int, times: dict[str, list[float]], bytes_per_element: dict[str, int], rows: dict[str, dict]
) -> float:
    """Fill ``rows`` and print the table; returns the memcpy bandwidth (bytes/s)."""
    copy = 8 * n / statistics.median(times["memcpy"])
    print(f"{'implementation':<28} {'ms':>9} {'GB/s':>7} {'/memcpy':>8} {'best GB/s':>10}")
    for name, nbytes in bytes_per_element.items():
        median, best = statistics.median(times[name]), min(times[name])
        rate = nbytes * n / median
        rows[name] = {
            "ms_median": median * 1e3,
            "ms_min": best * 1e3,
            "bytes_per_element": nbytes,
            "gbs": rate / 1e9,
            "gbs_best": nbytes * n / best / 1e9,
            "fraction_of_memcpy": rate / copy,
            "ms_rounds": [round(t * 1e3, 3) for t in times[name]],
        }
        print(f"{name:<28} {median * 1e3:>9.1f} {rate / 1e9:>7.2f} {rate / copy:>8.2f} {rows[name]['gbs_best']:>10.2f}")
    return copy


def _targets(times: dict[str, list[float]], rows: dict[str, dict]) -> dict[str, float]:
    """The issue's targets and the other engine rows against DeepSpeedCPUAdam, printed."""
    targets: dict[str, float] = {}
    if "engine fp32" not in times:
        return targets
    targets["engine_fraction_of_memcpy"] = rows["engine fp32"]["fraction_of_memcpy"]
    line = f"engine fp32: {targets['engine_fraction_of_memcpy']:.0%} of memcpy (target >= 70%)"
    if "DeepSpeedCPUAdam" in times:
        targets["engine_over_deepspeed_paired_median"] = _paired(times, "DeepSpeedCPUAdam", "engine fp32")
        targets["engine_over_deepspeed_of_medians"] = rows["engine fp32"]["gbs"] / rows["DeepSpeedCPUAdam"]["gbs"]
        wins = sum(d >= e for d, e in zip(times["DeepSpeedCPUAdam"], times["engine fp32"]))
        targets["engine_faster_in_rounds"] = wins
        line += (
            f", {targets['engine_over_deepspeed_paired_median']:.3f}x DeepSpeedCPUAdam (median of per-round "
            f"ratios; {targets['engine_over_deepspeed_of_medians']:.3f}x of medians; as fast or faster in "
            f"{wins}/{len(times['engine fp32'])} rounds; target >= 1)"
        )
    print(line)
    if "DeepSpeedCPUAdam A/A" in times:
        targets["deepspeed_a_a_paired_median"] = ratio = _paired(times, "DeepSpeedCPUAdam", "DeepSpeedCPUAdam A/A")
        print(
            f"A/A control: DeepSpeedCPUAdam against a second DeepSpeedCPUAdam on the same buffers {ratio:.3f}x "
            "(how far a ratio of identical work strays from 1 in this run)"
        )
    for name in ("engine fp32 clipped", "engine bf16+shadow", "engine bf16 clipped"):
        if name in times and "DeepSpeedCPUAdam" in times:
            targets[f"{name} over deepspeed (paired median)"] = ratio = _paired(times, "DeepSpeedCPUAdam", name)
            print(f"{name}: {ratio:.3f}x DeepSpeedCPUAdam's speed, doing more work")
    if "engine fp32 [host_empty]" in times and "DeepSpeedCPUAdam [own state]" in times:
        ratio = _paired(times, "DeepSpeedCPUAdam [own state]", "engine fp32 [host_empty]")
        targets["engine fp32 [host_empty] over DeepSpeedCPUAdam [own state] (paired median)"] = ratio
        print(f"engine fp32 [host_empty]: {ratio:.3f}x DeepSpeedCPUAdam [own state] (each with its own allocation)")
    return targets


def _contended_rows(n: int, runs: dict[str, Callable[[], None]], rounds: int) -> dict[str, dict]:
    contended_runs = {name: runs[name] for name in CONTENDED_ROWS if name in runs}
    if rounds <= 0 or "DeepSpeedCPUAdam" not in contended_runs:
        return {}
    times = _contended(contended_runs, rounds)
    print(f"beside one busy process (median of {rounds} shuffled rounds):")
    rows = {}
    for name in contended_runs:
        median = statistics.median(times[name])
        rows[name] = {
            "ms_median": median * 1e3,
            "gbs": BYTES_PER_ELEMENT * n / median / 1e9,
            "over_deepspeed_paired_median": _paired(times, "DeepSpeedCPUAdam", name),
            "ms_rounds": [round(t * 1e3, 3) for t in times[name]],
        }
        print(
            f"  {name:<26} {median * 1e3:>9.1f} ms {rows[name]['gbs']:>7.2f} GB/s "
            f"{rows[name]['over_deepspeed_paired_median']:>6.3f}x DeepSpeedCPUAdam"
        )
    return rows


def _interference(n: int) -> dict[str, float | str]:
    small = max(1 << 20, n // 16)  # short calls, as the engine issues them per chunk
    probes = {
        "engine kernel=" + name: lambda name=name: _engine_update(
            Buffers.allocate(_engine_numel(small)), name, torch.float32, False
        )
        for name in CPU_KERNELS
    }
    probes["torch AdamW foreach"] = lambda: _torch_adamw(Buffers.allocate(small), foreach=True)
    probes["DeepSpeedCPUAdam (its own binding)"] = lambda: _deepspeed_cpu_adam(Buffers.allocate(small))
    print("training-thread slowdown while a worker thread updates back to back (1.0 = none):")
    interference: dict[str, float | str] = {}
    for name, build in probes.items():
        try:
            interference[name] = value = _gil_interference(build())
            print(f"  {name:<36} {value:.2f}x")
        except Exception as error:
            interference[name] = f"{type(error).__name__}: {error}"
            print(f"  {name:<36} {interference[name]}")
    return interference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--elements",
        type=int,
        default=30_000_000,
        help="parameters updated per call (avoid powers of two: see the module docstring)",
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--contended-rounds",
        type=int,
        default=9,
        help="rounds of the main rows again beside one busy process (0: skip)",
    )
    parser.add_argument("--skip-gil", action="store_true", help="skip the training-thread interference probe")
    args = parser.parse_args(argv)
    n = _engine_numel(args.elements)
    load_before = os.getloadavg()
    rows: dict[str, dict] = {}
    runs, bytes_per_element = _build(_candidates(n, Buffers.allocate(n)), rows)

    times = _measure(runs, args.rounds)
    print(
        f"{_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {n} elements, "
        f"median of {args.rounds} shuffled rounds; load average before {load_before[0]:.2f}"
    )
    print(
        "every AdamW row but the [bracketed] ones updates the same p, m, v and gradient buffers; 'engine fp32', "
        "the torch rows and DeepSpeedCPUAdam do the same work, the other engine rows more (scaling, widening, "
        "shadow, journal)"
    )
    copy = _print_rows(n, times, bytes_per_element, rows)
    targets = _targets(times, rows)
    contended = _contended_rows(n, runs, args.contended_rounds)
    interference = {} if args.skip_gil else _interference(n)

    load_after = os.getloadavg()
    print(f"load average after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")
    report = {
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "elements": n,
        "rounds": args.rounds,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "engine_cpu_kernel": make_cpu_kernel("auto").name,
        "method": "shared buffers for every AdamW row but the [bracketed] ones; rows shuffled every round "
        "(seeded); medians; engine/DeepSpeed also as the median of per-round ratios, with an A/A "
        "control (DeepSpeedCPUAdam against itself)",
        "load_average_before": load_before,
        "load_average_after": load_after,
        "memcpy_gbs": copy / 1e9,
        "targets": targets,
        "contended": contended,
        "rows": rows,
        "training_thread_slowdown": interference,
    }
    try:
        import deepspeed

        report["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    output = args.output or (
        Path(__file__).resolve().parent
        / "results"
        / f"optimizer_{re.sub(r'[^A-Za-z0-9]+', '_', _cpu_name()).strip('_')}.json"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
