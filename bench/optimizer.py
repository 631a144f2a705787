"""Host AdamW throughput: the engine's CPU path against torch and DeepSpeed, side by side.

Each implementation updates the same number of fp32 parameters; throughput is counted in
bytes of optimizer state *touched* per second, 28 bytes per element:

    read p, g, m, v (4 + 4 + 4 + 4) + write p, m, v (4 + 4 + 4)          fp32 gradient
    read p, g, m, v (4 + 2 + 4 + 4) + write p, m, v, shadow (12 + 2)     bf16 gradient + bf16 shadow

and set against the host memcpy bandwidth measured in the same run (``copy_`` of a large
fp32 buffer, read + written bytes, the STREAM convention). Rows:

  memcpy                  torch ``copy_``, the yardstick
  engine fp32             the engine's ``HostAdamW.update_range`` with its CPU kernel ("auto"):
                          fp32 gradient, no shadow (the same work as the next two rows)
  torch AdamW foreach     ``torch.optim.AdamW(foreach=True).step()`` on one parameter
  torch AdamW fused       ``torch.optim.AdamW(fused=True).step()``: the kernel "engine fp32" runs
  DeepSpeedCPUAdam        ``deepspeed.ops.adam.DeepSpeedCPUAdam.step()`` on one parameter
  engine bf16+shadow      the engine's layout in bf16 compute: bf16 gradient, bf16 shadow written
  engine journaled        bf16+shadow while journaling (a speculative step: speculative_step.py)
  engine kernel=K         the engine path with each other CPU kernel (torch_fused, torch)

The implementations run interleaved, round after round, and each row reports its median:
a machine shared with other jobs slows all of them alike. The load average before and
after is recorded; on a busy machine the numbers are lower bounds.

It also measures what each kernel costs the *training* thread when it runs on the engine's
gradient worker: a main-thread loop of small torch ops (like backward's Python) timed
alone and while a worker thread updates back to back, for each engine kernel and for
``DeepSpeedCPUAdam`` through DeepSpeed's own binding, which holds the GIL ([Note: the GIL
and DeepSpeed's op] in ``megatrain_ds/cpu_adam.py``). On a machine with few cores the
ratio also contains plain CPU contention (the worker's threads use every core).

Usage:  python bench/optimizer.py [--elements 33554432] [--rounds 5] [--output PATH]
Writes bench/results/optimizer_<cpu>.json unless --output says otherwise. DeepSpeed's op
JIT-compiles on first use (25-110 s, cached in ~/.cache/torch_extensions); so does the
engine's build of DeepSpeed's kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

for _key, _value in {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29537",
                     "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402

from megatrain_ds.cpu_adam import CPU_KERNELS, make_cpu_kernel  # noqa: E402
from megatrain_ds.flat_layout import build_flat_layout  # noqa: E402
from megatrain_ds.host_adamw import HostAdamW  # noqa: E402
from megatrain_ds.host_store import HostFlatState  # noqa: E402
from megatrain_ds.speculative_step import Journal  # noqa: E402

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


def _engine_state(n: int, grad_dtype: torch.dtype, shadow: bool) -> tuple[HostFlatState, torch.Tensor]:
    layout = build_flat_layout([("w", torch.Size([n]), 0)])
    master = torch.randn(layout.numel)
    state = HostFlatState(layout=layout, master=master,
                          shadow=master.to(torch.bfloat16) if shadow else None,
                          exp_avg=torch.zeros(layout.numel), exp_avg_sq=torch.zeros(layout.numel))
    return state, torch.randn(layout.numel).to(grad_dtype)


class _Counter:
    def __init__(self) -> None:
        self.step = 0

    def __call__(self) -> int:
        self.step += 1
        return self.step


def _engine_update(n: int, kernel_name: str, grad_dtype: torch.dtype, shadow: bool,
                   journaled: bool = False) -> tuple[Callable[[], None], str]:
    kernel = make_cpu_kernel(kernel_name)
    adamw = HostAdamW([dict(HYPER, params=[])], decoupled=True, cpu=kernel)
    state, grad = _engine_state(n, grad_dtype, shadow)
    journal = Journal([state], [0]) if journaled else None
    counter = _Counter()

    def run() -> None:
        save = None if journal is None else (lambda start, end: journal.save(0, start, end))
        adamw.update_range(state, 0, grad, step=counter(), before_chunk=save)
        if journal is not None:
            journal.clear()

    return run, kernel.name


def _torch_adamw(n: int, **implementation: bool) -> Callable[[], None]:
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    optimizer = torch.optim.AdamW([param], **implementation, **HYPER)
    return optimizer.step


def _deepspeed_cpu_adam(n: int) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    optimizer = DeepSpeedCPUAdam([param], adamw_mode=True, **HYPER)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 25, help="parameters updated per call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--skip-gil", action="store_true", help="skip the training-thread interference probe")
    args = parser.parse_args(argv)
    n = args.elements
    load_before = os.getloadavg()

    rows: dict[str, dict] = {}
    candidates: list[tuple[str, Callable[[], tuple[Callable[[], None], int]]]] = [
        ("memcpy", lambda: (_memcpy(n), 8)),
        ("engine fp32", lambda: (_engine_update(n, "auto", torch.float32, False)[0], BYTES_PER_ELEMENT)),
        ("torch AdamW foreach", lambda: (_torch_adamw(n, foreach=True), BYTES_PER_ELEMENT)),
        ("torch AdamW fused", lambda: (_torch_adamw(n, fused=True), BYTES_PER_ELEMENT)),
        ("DeepSpeedCPUAdam", lambda: (_deepspeed_cpu_adam(n), BYTES_PER_ELEMENT)),
        ("engine bf16+shadow", lambda: (_engine_update(n, "auto", torch.bfloat16, True)[0], BYTES_PER_ELEMENT)),
        ("engine journaled", lambda: (_engine_update(n, "auto", torch.bfloat16, True, True)[0],
                                      BYTES_PER_ELEMENT)),
    ]
    auto_kernel = make_cpu_kernel("auto").name
    for name in CPU_KERNELS:
        if name != auto_kernel:
            candidates.append((f"engine kernel={name}", lambda name=name: (
                _engine_update(n, name, torch.float32, False)[0], BYTES_PER_ELEMENT)))

    runs: dict[str, tuple[Callable[[], None], int]] = {}
    for name, build in candidates:
        try:
            runs[name] = build()
            runs[name][0]()  # warm-up: first touch of every page, JIT, thread pools
        except Exception as error:  # e.g. DeepSpeed's op fails to build here
            rows[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{name}: unavailable ({error})")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (fn, _) in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)

    copy_gbs = 8 * n / statistics.median(times["memcpy"]) / 1e9
    print(f"{_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {n} elements, "
          f"median of {args.rounds}; load average before {load_before[0]:.2f}")
    print(f"{'implementation':<28} {'ms':>9} {'GB/s':>7} {'/memcpy':>8} {'best GB/s':>10}")
    for name, (fn, bytes_per_element) in runs.items():
        median, best = statistics.median(times[name]), min(times[name])
        gbs = bytes_per_element * n / median / 1e9
        rows[name] = {"ms_median": median * 1e3, "ms_min": best * 1e3, "bytes_per_element": bytes_per_element,
                      "gbs": gbs, "gbs_best": bytes_per_element * n / best / 1e9, "fraction_of_memcpy": gbs / copy_gbs}
        print(f"{name:<28} {median * 1e3:>9.1f} {gbs:>7.2f} {gbs / copy_gbs:>8.2f} {rows[name]['gbs_best']:>10.2f}")
    engine, deepspeed = rows.get("engine fp32", {}), rows.get("DeepSpeedCPUAdam", {})
    if "gbs" in engine:
        print(f"engine fp32: {engine['fraction_of_memcpy']:.0%} of memcpy (target >= 70%)"
              + (f", {engine['gbs'] / deepspeed['gbs']:.2f}x DeepSpeedCPUAdam (target >= 1)" if "gbs" in deepspeed else ""))

    interference = {}
    if not args.skip_gil:
        small = max(1 << 20, n // 16)  # short calls, as the engine issues them per chunk
        probes = {"engine kernel=" + name: lambda name=name: _engine_update(small, name, torch.float32, False)[0]
                  for name in CPU_KERNELS}
        probes["torch AdamW foreach"] = lambda: _torch_adamw(small, foreach=True)
        probes["DeepSpeedCPUAdam (its own binding)"] = lambda: _deepspeed_cpu_adam(small)
        print("training-thread slowdown while a worker thread updates back to back (1.0 = none):")
        for name, build in probes.items():
            try:
                interference[name] = _gil_interference(build())
            except Exception as error:
                interference[name] = f"{type(error).__name__}: {error}"
            value = interference[name]
            print(f"  {name:<36} {value:.2f}x" if isinstance(value, float) else f"  {name:<36} {value}")

    load_after = os.getloadavg()
    print(f"load average after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")
    report = {
        "cpu": _cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "elements": n, "rounds": args.rounds,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "engine_cpu_kernel": auto_kernel,
        "load_average_before": load_before, "load_average_after": load_after,
        "memcpy_gbs": copy_gbs, "rows": rows, "training_thread_slowdown": interference,
    }
    try:
        import deepspeed

        report["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    output = args.output or (Path(__file__).resolve().parent / "results"
                             / f"optimizer_{re.sub(r'[^A-Za-z0-9]+', '_', _cpu_name()).strip('_')}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
