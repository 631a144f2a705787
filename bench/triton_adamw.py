"""Benchmark the fused Triton AdamW kernel (``megatrain_triton.adamw_step_``) on a CUDA GPU.

AdamW is bound by memory bandwidth, so the kernel is judged by the bandwidth it reaches:

    bytes per element = read (p, g, m, v) + write (p, m, v[, shadow])
                      = 28 B with an fp32 gradient and no shadow
                      = 28 B with a bf16 gradient and a bf16 shadow (the engine's layout)

against two yardsticks measured on the same device:
  * a device-to-device ``copy_`` of a large buffer (read + write), the practical ceiling;
  * ``torch.optim.AdamW(fused=True)`` on one parameter of the same size (28 B/element),
    both through ``optimizer.step()`` (what a user pays, Python included) and, where the
    private op exists, ``torch._fused_adamw_`` alone.
It also sweeps (BLOCK_SIZE, num_warps) so the launcher's default can be checked.

Usage:  python bench/triton_adamw.py [--sizes 1048576 16777216 ...] [--output PATH]
Writes bench/results/triton_adamw_<device-name>.json unless --output says otherwise.
Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

DEFAULT_SIZES = [2**20, 2**24, 2**26, 2**28]  # 1M .. 256M elements (256M: ~4.5 GiB of state)
COPY_BYTES = 2**30  # 1 GiB source buffer for the copy-bandwidth ceiling
SWEEP = [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]  # (BLOCK_SIZE, num_warps)
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _median_ms(fn) -> float:
    import triton.testing

    # median over ~200 ms of runs; do_bench flushes L2 before each timed run.
    return float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))


def _copy_bandwidth_gbs(device: torch.device) -> float:
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


def _bench_kernel(n: int, grad_dtype: torch.dtype, with_shadow: bool, device: torch.device) -> dict:
    from megatrain_triton import adamw
    from megatrain_triton.adamw import _launch

    param = torch.randn(n, device=device)
    grad = torch.randn(n, device=device).to(grad_dtype)
    exp_avg = torch.zeros(n, device=device)
    exp_avg_sq = torch.zeros(n, device=device)
    shadow = torch.empty(n, dtype=torch.bfloat16, device=device) if with_shadow else None
    bytes_moved = n * (4 + grad.element_size() + 4 + 4) + n * (4 + 4 + 4 + (2 if with_shadow else 0))

    # The public launcher, as the engine calls it (host-side scalar maths included).
    def step() -> None:
        adamw.adamw_step_(param, grad, exp_avg, exp_avg_sq, **HYPER, step=10, shadow=shadow)

    ms = _median_ms(step)
    beta1, beta2 = HYPER["betas"]
    scalars = dict(
        grad_scale=1.0,
        decay_factor=1.0 - HYPER["lr"] * HYPER["weight_decay"],
        weight_decay=HYPER["weight_decay"],
        one_minus_beta1=1.0 - beta1,
        beta2=beta2,
        one_minus_beta2=1.0 - beta2,
        neg_step_size=-HYPER["lr"] / (1.0 - beta1**10),
        bias_correction2_sqrt=(1.0 - beta2**10) ** 0.5,
        eps=HYPER["eps"],
        decoupled=True,
    )
    sweep = {}
    for block_size, num_warps in SWEEP:
        sweep_ms = _median_ms(
            lambda: _launch(
                param, grad, exp_avg, exp_avg_sq, shadow, n, **scalars, block_size=block_size, num_warps=num_warps
            )
        )
        sweep[f"{block_size}x{num_warps}"] = {"ms": sweep_ms, "gbs": bytes_moved / (sweep_ms * 1e-3) / 1e9}
    return {"ms": ms, "bytes": bytes_moved, "gbs": bytes_moved / (ms * 1e-3) / 1e9, "sweep": sweep}


def _bench_torch_fused(n: int, device: torch.device) -> dict:
    param = torch.nn.Parameter(torch.randn(n, device=device))
    param.grad = torch.randn(n, device=device)
    optimizer = torch.optim.AdamW([param], **HYPER, fused=True)
    optimizer.step()  # creates the state
    step_ms = _median_ms(optimizer.step)
    result = {"step_ms": step_ms, "step_gbs": 28 * n / (step_ms * 1e-3) / 1e9, "op_ms": None}
    fused_op = getattr(torch, "_fused_adamw_", None)
    if fused_op is not None:
        state = optimizer.state[param]
        beta1, beta2 = HYPER["betas"]
        try:
            op_ms = _median_ms(
                lambda: fused_op(
                    [param.detach()],
                    [param.grad],
                    [state["exp_avg"]],
                    [state["exp_avg_sq"]],
                    [],
                    [state["step"]],
                    lr=HYPER["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=HYPER["weight_decay"],
                    eps=HYPER["eps"],
                    amsgrad=False,
                    maximize=False,
                )
            )
            result.update(op_ms=op_ms, op_gbs=28 * n / (op_ms * 1e-3) / 1e9)
        except (RuntimeError, TypeError) as err:  # private op: its signature may change
            result["op_error"] = str(err)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="element counts")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default: bench/results/...)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    from megatrain_triton import INTERPRETED

    if INTERPRETED:
        print("TRITON_INTERPRET=1 is set: the kernel would run in the interpreter; unset it to benchmark")
        return 2

    import triton

    device = torch.device("cuda")
    device_name = torch.cuda.get_device_name(device)
    copy_gbs = _copy_bandwidth_gbs(device)
    print(f"{device_name}: device-to-device copy {copy_gbs:.0f} GB/s (read + write of {COPY_BYTES >> 20} MiB)")
    print(
        f"{'elements':>11} {'mode':>16} {'kernel ms':>10} {'GB/s':>7} {'/copy':>6} "
        f"{'fused step ms':>14} {'fused op ms':>12} {'step/kernel':>12} {'op/kernel':>10}  best sweep"
    )

    rows = []
    for n in args.sizes:
        fused = _bench_torch_fused(n, device)
        for mode, grad_dtype, with_shadow in [
            ("fp32 grad", torch.float32, False),
            ("bf16 grad+shadow", torch.bfloat16, True),
        ]:
            kernel = _bench_kernel(n, grad_dtype, with_shadow, device)
            best = min(kernel["sweep"].items(), key=lambda item: item[1]["ms"])
            row = {
                "elements": n,
                "mode": mode,
                "kernel": kernel,
                "torch_fused": fused,
                "kernel_over_copy_bandwidth": kernel["gbs"] / copy_gbs,
                "fused_step_over_kernel_time": fused["step_ms"] / kernel["ms"],
                "fused_op_over_kernel_time": (fused["op_ms"] / kernel["ms"]) if fused["op_ms"] else None,
            }
            rows.append(row)
            op_ms = f"{fused['op_ms']:.3f}" if fused["op_ms"] else "n/a"
            op_ratio = f"{row['fused_op_over_kernel_time']:.2f}" if fused["op_ms"] else "n/a"
            print(
                f"{n:>11} {mode:>16} {kernel['ms']:>10.3f} {kernel['gbs']:>7.0f} "
                f"{row['kernel_over_copy_bandwidth']:>6.2f} {fused['step_ms']:>14.3f} {op_ms:>12} "
                f"{row['fused_step_over_kernel_time']:>12.2f} {op_ratio:>10}  {best[0]} ({best[1]['gbs']:.0f} GB/s)"
            )
        torch.cuda.empty_cache()

    from megatrain_triton.adamw import BLOCK_SIZE, NUM_WARPS

    report = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "default_config": f"{BLOCK_SIZE}x{NUM_WARPS}",
        "copy_gbs": copy_gbs,
        "hyperparameters": HYPER,
        "rows": rows,
    }
    output = args.output or (
        Path(__file__).resolve().parent
        / "results"
        / f"triton_adamw_{re.sub(r'[^A-Za-z0-9]+', '_', device_name).strip('_')}.json"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
