"""Per-node host memory, step time and optimizer time of 1, 2 and 4 simulated nodes.

Each simulated node is its own ``torchrun --nnodes N --node-rank i --nproc-per-node 1``
launch on this one machine (c10d rendezvous on 127.0.0.1; torchrun's ``GROUP_RANK`` makes
each launch a node of its own, with its own host copy of the state, as
``tests/test_data_parallel.py`` launches them). Every run trains the same Llama-shaped fp32
model with gradient clipping (so gradients are held) on the same global batch: each rank's
micro-batch is ``--global-batch / N`` sequences, no accumulation. After ``--warmup`` steps,
``--steps`` steps are timed. For every node the bench samples the proportional set size
(PSS, from ``/proc/<pid>/smaps_rollup``, every 50 ms, summed over the node's processes) and
reports, the maximum over the nodes:

- ``peak B/param``: the node's peak PSS, initialisation included, less its processes' PSS
  before the model was built (interpreter, libraries, process group), per parameter;
- ``host_bytes B/param``: the engine's own persistent host state (``engine.host_bytes()``,
  by kind), per parameter, to compare with the peak;
- ``step s``: median wall time of one optimizer step: forward, backward and ``step()``;
- ``opt s``: median wall time of the ``step()`` call at the accumulation boundary: it waits
  for the gradient worker to drain (the last gradients' accumulation and reduction), sums
  the gradient norm over the ranks, runs the AdamW updates not already done during backward
  (with clipping active every step, as here on a random-init model, that is all of them:
  ``speculated_elements`` in the JSON says how many were done during backward), clears the
  held gradients and waits at the node barrier. For DeepSpeed, its ``engine.step()``;
- ``adamw s``: the engine's AdamW arithmetic alone, per step (sum of its ``adamw`` spans on
  the optimizer-worker track of a tracer installed for the timed steps, wherever they ran).

With ``--bf16`` both systems compute in bf16 (fp32 masters). With ``--nvme PATH`` the
engine keeps Adam's m and v of the blocks on the NVMe tier, 2 blocks in host memory (each
rank its own swap files under ``PATH``, on its node's disk: docs/nvme-tier.md); with
``--nvme-weights`` too, the blocks' weights as well (``"nvme_offload": "all"``): each rank
keeps only its window of every block and the blocks are gathered from the windows when
used (docs/data-parallel.md).

With ``--systems megatrain deepspeed`` DeepSpeed's ZeRO-3 with ``offload_optimizer`` and
``offload_param`` on the CPU runs under the same launches (model built under
``deepspeed.zero.Init``, gloo; ``engine.step()`` timed the same way); a run that fails keeps
its error in the JSON.

    python bench/scale_out.py --hidden 1024 --layers 6 --nodes 1 2 4 --json bench/results/scale_out_cpu.json

The simulated nodes share this machine's cores: with ``--threads`` per node (default 1),
more nodes than cores compete for them, so step times at such N measure the contention as
much as the engine. The memory columns do not depend on that, but each node's transients
(activations, logits: host memory on a CPU run) follow its micro-batch, which shrinks as N
grows; the ``host_bytes`` column is the persistent state alone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from data_parallel_memory import pss_bytes  # bench/ is this script's directory: on sys.path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 32000
CLIPPING = 1.0
SYSTEMS = ("megatrain", "deepspeed")
# The per-step times a rank reports (its medians) and a node reports (its slowest rank's).
TIMES = ("step_s", "optimizer_s", "step_cpu_s", "adamw_s", "step_finish_s")


def children(pid: int) -> list[str]:
    """The child processes of ``pid`` (whichever of its threads started them), from
    ``/proc/<pid>/task/<tid>/children``; ``pgrep -P`` where the kernel has no such files."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # exited
        return []
    found: list[str] = []
    readable = False
    for task in tasks:
        with contextlib.suppress(FileNotFoundError):  # a thread that has ended, or no such file
            found += Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            readable = True
    if readable:
        return found
    return subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# -- one rank (under torchrun) -----------------------------------------------------------------


def _llama(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 128),
        attn_implementation="sdpa",
    )


def _batch_config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    return {
        **({"bf16": {"enabled": True}} if args.bf16 else {}),
        "train_micro_batch_size_per_gpu": args.global_batch // world,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.global_batch,
        "gradient_clipping": CLIPPING,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
    }


def _adamw_seconds(tracer: Any, step: int) -> tuple[float | None, float | None]:
    """This step's AdamW range updates and its ``step finish`` span, seconds (None: no such spans)."""
    adamw, finish = [], []
    for span in tracer.spans():
        if span.args.get("step") != step or span.track != "optimizer worker":
            continue
        if span.name.startswith("adamw "):
            adamw.append(span.end_ns - span.start_ns)
        elif span.name == "step finish":
            finish.append(span.end_ns - span.start_ns)
    return (sum(adamw) / 1e9 if adamw else None), (sum(finish) / 1e9 if finish else None)


def _init_process_group(args: argparse.Namespace) -> None:
    """The gloo process group, through each system's own entry point (DeepSpeed's sets up its
    communication backend too), so that the PSS baseline taken next includes it."""
    import deepspeed
    import torch.distributed as dist

    if args.system == "deepspeed":
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))


def _deepspeed_engine(args: argparse.Namespace, llama: Any, config: dict[str, Any]) -> tuple[Any, int]:
    """DeepSpeed's ZeRO-3 engine with optimizer and parameters offloaded to the CPU, the model
    built under ``zero.Init`` (so no rank holds it whole); and the parameter count, from
    ``ds_numel`` since the partitioned parameters' own ``numel()`` is their shard. Adds the
    ``zero_optimization`` section to ``config``."""
    import deepspeed

    config["zero_optimization"] = {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False},
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = llama(_llama(args))
    params = sum(p.ds_numel for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine, params


def _train_step(args: argparse.Namespace, engine: Any, step: int, rank: int, micro: int) -> dict[str, Any]:
    """One optimizer step on this rank's slice of the step's global batch, timed: the whole
    step, its ``step()`` call, the process CPU time, and the loss. The batch is drawn from a
    per-step seed so that every N trains on the same global batch."""
    import torch

    generator = torch.Generator().manual_seed(1000 + step)  # the same global batch for every N
    ids = torch.randint(0, VOCAB, (args.global_batch, args.seq_len), generator=generator)
    ids = ids[rank * micro : (rank + 1) * micro]
    cpu0, t0 = time.process_time(), time.perf_counter()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    t1 = time.perf_counter()
    engine.step()
    t2 = time.perf_counter()
    return {
        "step_s": t2 - t0,
        "optimizer_s": t2 - t1,
        "step_cpu_s": time.process_time() - cpu0,
        "loss": loss.item(),
    }


def _run_steps(args: argparse.Namespace, engine: Any, rank: int, micro: int) -> list[dict[str, Any]]:
    """``--warmup`` then ``--steps`` optimizer steps; the records of the timed ones. For
    MegaTrain a tracer is installed for the timed steps alone (its AdamW and step-finish spans
    per step) and removed afterwards; the engine's step report (outcome, norm, speculated
    elements) is added where the engine has one."""
    from megatrain_ds.runtime.trace import NULL_TRACER, Tracer

    steps: list[dict[str, Any]] = []
    tracer = None
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        if timed and args.system == "megatrain" and tracer is None:
            tracer = Tracer(engine.runtime)
            engine.runtime.tracer = tracer
        if tracer is not None:
            tracer.begin_step(step)
        record = _train_step(args, engine, step, rank, micro)
        if tracer is not None:
            tracer.end_step()
            record["adamw_s"], record["step_finish_s"] = _adamw_seconds(tracer, step)
        report = getattr(engine, "last_step_report", None)
        if report is not None:
            record.update(outcome=report.outcome.value, norm=report.norm, speculated_elements=report.speculated)
        if timed:
            steps.append(record)
    if tracer is not None:
        engine.runtime.tracer = NULL_TRACER
    return steps


def _megatrain_host_state(engine: Any) -> dict[str, Any]:
    """The MegaTrain engine's persistent host state, by kind and in all, and its node size
    (ranks sharing one host copy), for the rank's result."""
    host = engine.host_bytes()
    dp = engine.data_parallel
    return {
        "host_bytes_by_kind": host,
        "host_bytes": sum(host.values()),
        "node_size": dp.node_size if dp is not None else 1,
    }


def _rank_result(
    rank: int, node: int, params: int, micro: int, steps: list[dict[str, Any]], *, baseline: int, init_pss: int
) -> dict[str, Any]:
    """What a rank reports to the driver: its identity, its PSS before the model, after the
    engine was built and now (at the end), its timed steps and their median times."""
    return {
        "rank": rank,
        "node": node,
        "params": params,
        "baseline_pss_bytes": baseline,
        "after_init_pss_bytes": init_pss,
        "final_pss_bytes": pss_bytes("self"),
        "micro_batch": micro,
        "steps": steps,
        **{key: _median([s[key] for s in steps if key in s]) for key in TIMES},
    }


def worker(args: argparse.Namespace) -> None:
    """One rank: build, ``--warmup`` + ``--steps`` optimizer steps, write ``result<rank>.json``."""
    import deepspeed  # noqa: F401  (used by _init_process_group; imported first, as it always was)
    import torch
    import torch.distributed as dist
    import transformers

    import megatrain_ds

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ.get("GROUP_RANK", rank))
    torch.set_num_threads(args.threads)
    # The process group first, for both systems, so the baseline includes it.
    _init_process_group(args)
    out = Path(args.out)
    # Imported before the baseline, and before zero.Init: the lazily imported modeling module
    # imports torch._dynamo, whose polyfills refuse the tensor constructors zero.Init patches.
    llama = transformers.LlamaForCausalLM
    baseline = pss_bytes("self")
    config = _batch_config(args, world)
    torch.manual_seed(0)
    if args.system == "deepspeed":
        engine, params = _deepspeed_engine(args, llama, config)
    else:
        model = llama(_llama(args))
        params = sum(p.numel() for p in model.parameters())
        if args.nvme:  # each rank's window of the blocks' m and v (and weights) in its own swap files
            # A window of 2 blocks (default 4): this model has only 6.
            level = "all" if args.nvme_weights else "optimizer"
            config["megatrain"] = {"nvme_offload": level, "nvme_path": args.nvme, "nvme_window_blocks": 2}
        engine = megatrain_ds.MegatrainEngine(model, megatrain_ds.parse_engine_config(config))
    init_pss = pss_bytes("self")
    micro = args.global_batch // world
    steps = _run_steps(args, engine, rank, micro)
    result = _rank_result(rank, node, params, micro, steps, baseline=baseline, init_pss=init_pss)
    if args.system == "megatrain":
        result.update(_megatrain_host_state(engine))
        engine.destroy()
    Path(out, f"result{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()  # nobody tears the group down under a slower rank
        dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


def _error_line(text: str) -> str | None:
    """The worker's exception (its last ``[rankR]: ...Error: ...`` line), else the launcher's."""
    lines = [line.strip() for line in text.splitlines() if re.search(r"(Error|Exception)\b.*:", line)]
    raised = [line for line in lines if line.startswith("[rank")]
    return (raised or lines or [None])[-1]


def _descendants(pid: int) -> list[str]:
    found = children(pid)
    for child in list(found):
        found += _descendants(int(child))
    return found


def _kill(launch: subprocess.Popen, workers: set[str]) -> None:
    """The launcher (its own session, started here) and its workers: torchrun starts each
    worker in a session of its own, so they are killed by pid, the ones still its children
    and the ones seen while sampling (checked to still be this bench's workers)."""
    for pid in {*workers, *_descendants(launch.pid)}:
        with contextlib.suppress(OSError):
            if f"{Path(__file__).name}\0--worker" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(launch.pid, signal.SIGKILL)
    launch.wait()


def _launch_env(args: argparse.Namespace, system: str) -> dict[str, str]:
    """The launchers' environment: this one without the torchrun variables of any enclosing
    launch, on the CPU accelerator with ``--threads`` OpenMP threads, the repository importable,
    and for DeepSpeed the MegaTrain routing hook disabled."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(args.threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "triton_kernels"), env.get("PYTHONPATH")]))
    if system == "deepspeed":
        env["MEGATRAIN_DISABLE_HOOK"] = "1"  # DeepSpeed's own engine, untouched
    return env


def _torchrun_commands(args: argparse.Namespace, system: str, nodes: int, out: Path) -> list[list[str]]:
    """One ``torchrun`` command line per simulated node, all meeting at one c10d endpoint on a
    free local port, each running this script's ``--worker`` with the run's options."""
    endpoint = f"127.0.0.1:{_free_port()}"
    forwarded = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in ("hidden", "layers", "global_batch", "seq_len", "warmup", "steps", "threads", "timeout")
    ]
    if args.nvme:
        forwarded.append(f"--nvme={args.nvme}")
    if args.nvme_weights:
        forwarded.append("--nvme-weights")
    if args.bf16:
        forwarded.append("--bf16")
    return [
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes)),
            *("--node-rank", str(node), "--nproc-per-node", "1"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint),
            *("--rdzv-conf", f"is_host={int(node == 0)}"),  # node 0 hosts the store
            *(__file__, "--worker", "--system", system, "--out", str(out), *forwarded),
        ]
        for node in range(nodes)
    ]


def _node_pss(launch: subprocess.Popen, workers: set[str]) -> int:
    """The summed PSS of a launcher's children (the node's workers) now; adds their pids to
    ``workers``, so that they can be killed even once they are no longer its children."""
    total = 0
    for pid in children(launch.pid):
        workers.add(pid)
        with contextlib.suppress(OSError):  # exited between listing and reading
            total += pss_bytes(pid)
    return total


def _sample_until_done(launches: list[subprocess.Popen], peaks: list[int], workers: set[str], deadline: float) -> None:
    """Every 50 ms, raise each node's entry of ``peaks`` to its current PSS, until every
    launcher has exited, ``deadline`` (perf_counter) has passed, or 15 s after one failed."""
    failed_at: float | None = None
    while any(launch.poll() is None for launch in launches):
        now = time.perf_counter()
        if now > deadline:
            break
        if failed_at is None and any(launch.returncode not in (None, 0) for launch in launches):
            failed_at = now  # the others wait for it in a collective: give them a moment
        if failed_at is not None and now - failed_at > 15:
            break
        for node, launch in enumerate(launches):
            peaks[node] = max(peaks[node], _node_pss(launch, workers))
        time.sleep(0.05)


def _run_nodes(
    commands: list[list[str]], env: dict[str, str], out: Path, deadline: float
) -> tuple[list[subprocess.Popen], list[tuple[Path, Path]], list[int], list[bool]]:
    """Start one launcher per command (its output in ``out/node<i>.out``/``.err``, each in a
    session of its own), sample the nodes' PSS until they are done, then kill whatever is left
    of them, whatever happened. Returns the launchers, their log paths, each node's peak PSS
    and whether each launcher was still running at the end (timed out)."""
    launches: list[subprocess.Popen] = []
    logs: list[tuple[Path, Path]] = []
    peaks = [0] * len(commands)
    workers: set[str] = set()  # every worker pid seen, to kill stragglers
    try:
        for node, command in enumerate(commands):
            logs.append((out / f"node{node}.out", out / f"node{node}.err"))
            with open(logs[-1][0], "w") as stdout, open(logs[-1][1], "w") as stderr:
                launches.append(
                    subprocess.Popen(command, env=env, cwd=REPO, stdout=stdout, stderr=stderr, start_new_session=True)
                )
        _sample_until_done(launches, peaks, workers, deadline)
    finally:
        timed_out = [launch.poll() is None for launch in launches]
        for launch in launches:
            _kill(launch, workers)
    return launches, logs, peaks, timed_out


def _read_results(out: Path) -> dict[int, dict[str, Any]]:
    """The ranks' ``result<rank>.json`` files in ``out``, by rank."""
    results = {}
    for path in out.glob("result*.json"):
        result = json.loads(path.read_text())
        results[result["rank"]] = result
    return results


def _failure(
    system: str,
    nodes: int,
    launches: list[subprocess.Popen],
    logs: list[tuple[Path, Path]],
    timed_out: list[bool],
    seconds: float,
) -> dict[str, Any]:
    """A run that left fewer results than nodes: print the launchers' stderr tails and return
    the record kept in the JSON (why it failed, the workers' error, the tails)."""
    codes = [launch.returncode for launch in launches]
    stderr = "\n".join(f"--- node {i} (exit {codes[i]}) ---\n{_tail(err)}" for i, (_, err) in enumerate(logs))
    print(f"{system}, {nodes} node(s): FAILED after {seconds:.0f} s; stderr tails:\n{stderr}", flush=True)
    return {
        "nodes": nodes,
        "failed": "timed out" if any(timed_out) else f"exit statuses {codes}",
        "error": next(filter(None, (_error_line(_tail(err, 20000)) for _, err in logs)), None),
        "stderr_tail": [_tail(err, 2000) for _, err in logs],
        "seconds": seconds,
    }


def _host_bytes_entry(rank: dict[str, Any], params: int) -> dict[str, Any]:
    """A node's persistent host state, in bytes and per parameter, in all and by kind."""
    # One host copy per node (shared by its ranks): any rank's view is the node's.
    return {
        "host_bytes_by_kind": rank["host_bytes_by_kind"],
        "host_bytes": rank["host_bytes"],
        "host_bytes_per_param": rank["host_bytes"] / params,
        "host_bytes_per_param_by_kind": {k: v / params for k, v in rank["host_bytes_by_kind"].items()},
    }


def _node_entry(node: int, ranks: list[dict[str, Any]], peak: int, params: int) -> dict[str, Any]:
    """One node's line of the JSON from its ranks' results and its sampled peak PSS: memory
    per parameter above its baseline, its slowest rank's times, outcomes and losses."""
    baseline = sum(r["baseline_pss_bytes"] for r in ranks)
    entry: dict[str, Any] = {
        "node": node,
        "ranks": [r["rank"] for r in ranks],
        "peak_pss_bytes": peak,
        "baseline_pss_bytes": baseline,
        "peak_bytes_per_param": peak / params,
        "peak_above_baseline_bytes_per_param": (peak - baseline) / params,
        # Every rank of a node times the same synchronised steps: its slowest rank.
        **{key: max((r[key] for r in ranks if r.get(key) is not None), default=None) for key in TIMES},
        "outcomes": sorted({s.get("outcome") for r in ranks for s in r["steps"] if s.get("outcome")}),
        "speculated_elements": [s.get("speculated_elements") for s in ranks[0]["steps"]],
        "losses": [s["loss"] for s in ranks[0]["steps"]],
    }
    if "host_bytes" in ranks[0]:
        entry.update(_host_bytes_entry(ranks[0], params))
    return entry


def _worst(per_node: list[dict[str, Any]], key: str) -> float | None:
    """The maximum of ``key`` over the nodes that have it (None: none has)."""
    values = [n[key] for n in per_node if n.get(key) is not None]
    return max(values) if values else None


def _summary(
    args: argparse.Namespace,
    nodes: int,
    results: dict[int, dict[str, Any]],
    peaks: list[int],
    load_before: tuple[float, float, float],
    seconds: float,
) -> dict[str, Any]:
    """A successful run's record: the worst node's figures, the load averages around it, and
    every node's entry; the by-kind host state of the node holding the most."""
    params = results[0]["params"]
    per_node = [
        _node_entry(node, [r for r in results.values() if r["node"] == node], peaks[node], params)
        for node in range(nodes)
    ]
    summary: dict[str, Any] = {
        "nodes": nodes,
        "params": params,
        "micro_batch_per_rank": args.global_batch // nodes,
        "peak_above_baseline_bytes_per_param": _worst(per_node, "peak_above_baseline_bytes_per_param"),
        "peak_bytes_per_param": _worst(per_node, "peak_bytes_per_param"),
        "host_bytes_per_param": _worst(per_node, "host_bytes_per_param"),
        "step_s": _worst(per_node, "step_s"),
        "optimizer_s": _worst(per_node, "optimizer_s"),
        "adamw_s": _worst(per_node, "adamw_s"),
        "step_cpu_s": _worst(per_node, "step_cpu_s"),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds": seconds,
        "per_node": per_node,
    }
    if any("host_bytes" in n for n in per_node):
        most = max((n for n in per_node if "host_bytes" in n), key=lambda n: n["host_bytes"])
        summary["host_bytes_per_param_by_kind"] = most["host_bytes_per_param_by_kind"]
    return summary


def measure(args: argparse.Namespace, system: str, nodes: int) -> dict[str, Any]:
    """Launch ``nodes`` simulated nodes of ``system``, sample each node's PSS, collect results."""
    with tempfile.TemporaryDirectory(prefix="scale_out_") as tmp:
        out = Path(tmp)
        env = _launch_env(args, system)
        commands = _torchrun_commands(args, system, nodes, out)
        load_before = os.getloadavg()
        started = time.perf_counter()
        launches, logs, peaks, timed_out = _run_nodes(commands, env, out, started + args.timeout)
        seconds = time.perf_counter() - started
        results = _read_results(out)
        if len(results) < nodes:
            return _failure(system, nodes, launches, logs, timed_out, seconds)
    return _summary(args, nodes, results, peaks, load_before, seconds)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    def kinds(row: dict[str, Any]) -> str:
        by_kind = row.get("megatrain", {}).get("host_bytes_per_param_by_kind") or {}
        return " ".join(f"{kind}={value:.2f}" for kind, value in by_kind.items())

    width = max([len("host B/p by kind")] + [len(kinds(row)) for row in rows])
    header = (
        f"{'N':>2} {'micro':>5} | {'peak B/p':>8} {'host B/p':>8} {'step s':>7} {'opt s':>7} {'adamw s':>7} | "
        f"{'DS peak':>7} {'DS step':>7} {'DS opt':>7} | {'host B/p by kind':<{width}}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ours, theirs = row.get("megatrain", {}), row.get("deepspeed", {})
        ds_peak = "failed" if "failed" in theirs else _fmt(theirs.get("peak_above_baseline_bytes_per_param"), ".2f")
        print(
            f"{row['nodes']:>2} {_fmt(row.get('micro_batch_per_rank'), 'd'):>5} | "
            f"{_fmt(ours.get('peak_above_baseline_bytes_per_param'), '.2f'):>8} "
            f"{_fmt(ours.get('host_bytes_per_param'), '.2f'):>8} "
            f"{_fmt(ours.get('step_s'), '.2f'):>7} {_fmt(ours.get('optimizer_s'), '.3f'):>7} "
            f"{_fmt(ours.get('adamw_s'), '.3f'):>7} | {ds_peak:>7} "
            f"{_fmt(theirs.get('step_s'), '.2f'):>7} {_fmt(theirs.get('optimizer_s'), '.3f'):>7} | {kinds(row)}"
        )
    print(
        "peak B/p: max over nodes of (peak node PSS - its PSS before the model) / params; "
        "host B/p: engine.host_bytes() / params;\n"
        "step s, opt s: median wall time of a whole optimizer step, of its step() call (slowest node); "
        "adamw s: the engine's AdamW arithmetic per step"
    )


def _parser() -> argparse.ArgumentParser:
    """The command line: the model's size, the node counts and systems to run, the batch and
    step counts, and the hidden options the driver passes to its ``--worker`` ranks."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6, help="6: 140M parameters at hidden 1024")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step; divisible by every N")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch (all its nodes)")
    parser.add_argument("--nvme", help="megatrain: Adam's m and v on the NVMe tier, swap files under this path")
    parser.add_argument("--nvme-weights", action="store_true", help="with --nvme: the blocks' weights on it too")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 masters (both systems)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def _run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every system at every node count, a row per node count; a line per successful run as
    it finishes, since a whole sweep takes minutes."""
    rows: list[dict[str, Any]] = []
    for nodes in args.nodes:
        row: dict[str, Any] = {"nodes": nodes, "micro_batch_per_rank": args.global_batch // nodes}
        for system in args.systems:
            row[system] = measure(args, system, nodes)
            r = row[system]
            if "failed" not in r:
                print(
                    f"{system}, {nodes} node(s): peak {r['peak_above_baseline_bytes_per_param']:.2f} B/param above "
                    f"the baseline, step {r['step_s']:.2f} s, step() {r['optimizer_s']:.3f} s ({r['seconds']:.0f} s)",
                    flush=True,
                )
        rows.append(row)
    return rows


def _document(args: argparse.Namespace, rows: list[dict[str, Any]], total: float) -> dict[str, Any]:
    """The JSON written by ``--json``: the machine, revision and library versions, the model
    and the settings (so that a result can be told apart from another), and the runs."""
    from importlib import metadata

    return {
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "cpu_model": _cpu_model(),
        "git_rev": subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
        "versions": {name: metadata.version(name) for name in ("torch", "deepspeed", "transformers")},
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "vocab": VOCAB,
            "dtype": "bf16 compute, fp32 master" if args.bf16 else "fp32",
            "params": next((r[s]["params"] for r in rows for s in args.systems if "params" in r[s]), None),
        },
        "settings": {
            "global_batch": args.global_batch,
            "seq_len": args.seq_len,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "threads_per_node": args.threads,
            "megatrain_nvme": (f"{'all' if args.nvme_weights else 'optimizer'}, nvme_window_blocks 2")
            if args.nvme
            else "none",
            "gradient_clipping": CLIPPING,
            "launch": "one torchrun --nnodes N --node-rank i --nproc-per-node 1 per node, c10d on 127.0.0.1",
            "deepspeed": "ZeRO-3, offload_optimizer and offload_param cpu, zero.Init, gloo",
        },
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "total_seconds": total,
        "runs": rows,
    }


def main() -> None:
    """A ``--worker`` rank, or the driver: run the sweep, print the table, write ``--json``."""
    parser = _parser()
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    bad = [n for n in args.nodes if n < 1 or args.global_batch % n]
    if bad:
        parser.error(f"--global-batch {args.global_batch} is not divisible by --nodes {bad}")
    started = time.perf_counter()
    rows = _run_all(args)
    print()
    print_table(rows)
    failed = [(row["nodes"], s) for row in rows for s in args.systems if "failed" in row[s]]
    total = time.perf_counter() - started
    print(f"total {total:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_document(args, rows, total), indent=1) + "\n")
    if any(system == "megatrain" for _, system in failed):
        raise SystemExit(f"failed runs: {failed}")


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


if __name__ == "__main__":
    main()
