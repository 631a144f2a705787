"""Node host memory of a data-parallel run: 2 ranks vs 1 rank on the same model.

Launches ``torchrun --nproc_per_node N`` for N = 1 and 2 (alternating, ``--rounds``
times) on a Llama-shaped fp32 model with gradient clipping, and samples the proportional
set size (PSS: shared pages divided among the processes mapping them) of every rank
every 50 ms. Their sum is the node's memory; its peak, initialisation included, minus
the ranks' own sizes before the model was built (interpreter and libraries), is divided
by the parameter count.

    python bench/data_parallel_memory.py --hidden 1024 --layers 16 --json bench/results/data_parallel_memory_cpu.json

Target (issue: data parallel): the 2-rank node within 10% of the 1-rank run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pss_bytes(pid: int | str) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args: argparse.Namespace) -> None:
    """One rank (under torchrun): build, train ``--steps`` steps, report."""
    import torch
    import transformers

    from megatrain_ds import MegatrainEngine, parse_engine_config

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(rank)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128,
        attn_implementation="sdpa",
    )
    baseline = pss_bytes("self")
    Path(args.out, f"baseline{rank}").write_text(str(baseline))
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    engine = MegatrainEngine(
        model,
        parse_engine_config(
            {
                "train_micro_batch_size_per_gpu": args.micro_batch,
                "gradient_accumulation_steps": 1,
                "train_batch_size": args.micro_batch * world,
                "gradient_clipping": 1.0,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            }
        ),
    )
    generator = torch.Generator().manual_seed(rank)
    started = time.perf_counter()
    for _ in range(args.steps):
        ids = torch.randint(0, 32000, (args.micro_batch, args.seq_len), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    Path(args.out, f"done{rank}").write_text(
        json.dumps({"params": params, "seconds_per_step": (time.perf_counter() - started) / args.steps})
    )
    engine.destroy()


def measure(args: argparse.Namespace, ranks: int) -> dict:
    """Run ``ranks`` ranks under torchrun and sample their summed PSS."""
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // ranks)))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(ranks),
            "--master_port",
            str(29700 + ranks),
            __file__,
            "--worker",
            "--out",
            out,
            *[
                f"--{k.replace('_', '-')}={v}"
                for k, v in vars(args).items()
                if k in ("hidden", "layers", "steps", "micro_batch", "seq_len")
            ],
        ]
        launcher = subprocess.Popen(command, env=env, cwd=REPO)
        peak = 0
        while launcher.poll() is None:
            children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
            total = 0
            for pid in children:
                with contextlib.suppress(OSError):  # exited between listing and reading
                    total += pss_bytes(pid)
            peak = max(peak, total)
            time.sleep(0.05)
        if launcher.returncode != 0:
            raise SystemExit(f"torchrun with {ranks} rank(s) failed ({launcher.returncode})")
        baseline = sum(int(Path(out, f"baseline{r}").read_text()) for r in range(ranks))
        done = json.loads(Path(out, "done0").read_text())
    params = done["params"]
    return {
        "ranks": ranks,
        "params": params,
        "peak_node_pss_bytes": peak,
        "baseline_pss_bytes": baseline,
        "peak_bytes_per_param": peak / params,
        "peak_above_baseline_bytes_per_param": (peak - baseline) / params,
        "seconds_per_step": done["seconds_per_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs: list[dict] = []
    for _ in range(args.rounds):
        for ranks in (1, 2):
            runs.append(measure(args, ranks))
            r = runs[-1]
            print(
                f"{ranks} rank(s): peak node PSS {r['peak_node_pss_bytes'] / 2**30:.2f} GiB = "
                f"{r['peak_bytes_per_param']:.2f} B/param ({r['peak_above_baseline_bytes_per_param']:.2f} "
                f"above the interpreters), {r['seconds_per_step']:.1f} s/step",
                flush=True,
            )
    one = min(r["peak_node_pss_bytes"] for r in runs if r["ranks"] == 1)
    two = min(r["peak_node_pss_bytes"] for r in runs if r["ranks"] == 2)
    one_above = min(r["peak_node_pss_bytes"] - r["baseline_pss_bytes"] for r in runs if r["ranks"] == 1)
    two_above = min(r["peak_node_pss_bytes"] - r["baseline_pss_bytes"] for r in runs if r["ranks"] == 2)
    summary = {"two_over_one": two / one, "two_over_one_above_baseline": two_above / one_above}
    print(
        f"2 ranks / 1 rank: {summary['two_over_one']:.3f} (whole processes), "
        f"{summary['two_over_one_above_baseline']:.3f} (above the interpreters); target <= 1.10"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                    "git_rev": subprocess.run(
                        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
                    ).stdout.strip(),
                    "model": {"hidden": args.hidden, "layers": args.layers, "vocab": 32000},
                    "batch": {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps},
                    "runs": runs,
                    "summary": summary,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
