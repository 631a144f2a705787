"""Side by side: this engine vs DeepSpeed ZeRO-3 and ZeRO-2 CPU offload vs plain PyTorch.

Same Llama-shaped model, same initial weights, same batches, same machine. A fair
comparison, as issue 42 asks:

- every system runs in a fresh process (so peak RSS and peak GPU memory are its own);
- each runs ``--warmup`` steps (default 3) and then ``--steps`` measured ones (default 5),
  and reports their **median** (DeepSpeed's first steps are much slower than its steady
  state: on the H200 ZeRO-3 offload took 1.59 / 1.12 / 0.65 s);
- every system starts from the same weights: each parameter is filled from a generator
  seeded by its name (:func:`same_initial_weights`), also under ``deepspeed.zero.Init``,
  where Hugging Face's own init never runs on the partitioned modules; the first loss of
  every system is reported side by side to prove it;
- DeepSpeed is configured as its docs advise for one GPU (``pin_memory``, ``overlap_comm``,
  ``contiguous_gradients``), and ZeRO-2 with ``offload_optimizer`` runs beside ZeRO-3
  offload (what a user picks when the weights fit the GPU; it fails where they do not);
- for every system: tokens/s, TFLOPS (6PT), peak host and GPU memory; for the engine also
  its optimizer placement (which states the ``"auto"`` placement put on the device, and how
  many the GPU tier kept there: ``"device_state": "auto"``, the default; the system
  ``megatrain_host_state`` keeps every state in host memory, and the engine's logged
  decisions with their reasons) and the planner's floor (the largest single bound of its
  model), for every engine system whatever ``--no-planner`` says.

Prints a table and writes one JSON under ``bench/results/``.

    python bench/compare.py --hidden 1536 --layers 16 --seq-len 128 --micro-batch 2
    python bench/compare.py --hidden 512 --layers 4 --systems megatrain torch --warmup 1 --steps 2

Counted FLOPs are 6*P*T (the recompute's extra 2*P*T for blocks is reported separately).
On a CPU-only machine everything is fp32 (``--bf16``: the engine and ZeRO compute in bf16
there too); with CUDA the engine and ZeRO compute in bf16 and plain PyTorch uses bf16 autocast.

The engine's step is also split by its own trace (``"megatrain": {"trace": ...}``, the
measured steps; ``megatrain_ds/runtime/trace.py``): ``device_idle_seconds`` is the step
less the union of its spans on the compute track (block forward, recompute, backward) --
the time the device spent waiting for weights or the optimizer, plus the head, loss and
embedding, which are not on that track (so an upper bound). The other systems are not
traced: theirs is reported as ``null``.

The planner is checked against the engine in the same run: right after each engine round,
``megatrain plan`` (fresh process) predicts the same model and batch with the round's
placement; its prediction goes into ``results.<engine system>.predicted_*`` with the ratios
predicted / measured. The first engine round's call measures the machine under the same
conditions as the round (``--probe`` on a GPU: the run's AdamW pass alone and beside pinned
copies, the link, a real block; ``--recalibrate`` on the CPU) and the later rounds reuse
those figures (``--hardware``), so every system is judged by the same ones; where each
figure came from is ``planner_hardware_sources``. With ``--no-planner`` the floor is still
recorded (``floor_seconds``, ``step_over_floor``, ``floor_by_bound``), from the declared
figures (no probe: the GPU table's, or the cached CPU profile; ``floor_figures``). Beside
the probe's ``block_efficiency`` goes the one the run's own compute spans give
(``block_efficiency_in_run``, ``block_efficiency_probe_over_run``). A planner call that
fails, hangs past ``PLANNER_TIMEOUT_S`` or prints no JSON leaves its reason in the round's
``planner_error`` and the benchmark goes on; a measuring call that failed is not made
again in later rounds. Peak host bytes are
the process's peak RSS above its RSS right before the model is built
(``baseline_rss_bytes``: the interpreter and libraries). ZeRO-3 offload needs ~25-40
B/param: a run is killed, not the machine, should ``MemAvailable`` fall under
``--min-free`` (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

# The host-only engine after DeepSpeed's systems: a run cut off by its time limit keeps those.
SYSTEMS = ("megatrain", "megatrain_no_recompute", "zero3_offload", "zero2_offload", "megatrain_host_state", "torch")
RESULT_KEY = {
    "megatrain": "megatrain",
    "megatrain_no_recompute": "megatrain_recompute_none",
    "megatrain_host_state": "megatrain_device_state_none",
    "zero3_offload": "deepspeed_zero3_offload",
    "zero2_offload": "deepspeed_zero2_offload_optimizer",
    "torch": "torch",
}
DEEPSPEED_SYSTEMS = ("zero3_offload", "zero2_offload")
INIT_STD = 0.02
"""Hugging Face's ``initializer_range`` for Llama: the std of every weight matrix."""
ENGINE_SYSTEMS = ("megatrain", "megatrain_no_recompute", "megatrain_host_state")
"""The engine with its defaults (every block recomputed, ``"device_state": "auto"``: as much
of the optimizer state as fits on the GPU), with ``"recompute": "none"``, and with
``"device_state": "none"`` (every optimizer state in host memory, streamed and stepped there)."""
SYSTEM_OPTIONS = {"megatrain_no_recompute": {"recompute": "none"}, "megatrain_host_state": {"device_state": "none"}}
"""What each engine system adds to ``--megatrain``'s options."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ds_config(system: str, args: argparse.Namespace, cuda: bool, trace: Path | None = None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "bf16": {"enabled": cuda or args.bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
    }
    if system in ENGINE_SYSTEMS:
        config["engine"] = "megatrain"
        config["megatrain"] = {
            **args.megatrain,
            **SYSTEM_OPTIONS.get(system, {}),
        }
        if trace is not None:  # every step after the trace's own first warm-up step: the last are the measured
            config["megatrain"].update(trace=str(trace), trace_steps=args.warmup - 1 + args.steps)
        if args.nvme_path:  # a ZeRO-Infinity JSON: the optimizer state on NVMe (the engine's NVMe tier)
            params_on = {"device": "nvme", "nvme_path": args.nvme_path} if args.nvme_weights else {"device": "cpu"}
            config["zero_optimization"] = {
                "stage": 3,
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": args.nvme_path,
                    "pin_memory": cuda,
                    "buffer_count": args.nvme_buffer_count,
                },
                "offload_param": {**params_on, "pin_memory": cuda},
            }
            config["aio"] = {
                "block_size": 1048576,
                "queue_depth": 8,
                "thread_count": 1,
                "single_submit": False,
                "overlap_events": True,
            }
    else:  # DeepSpeed as its docs advise for one GPU: pinned offload, overlapped, contiguous gradients
        config["zero_optimization"] = {
            "stage": 3 if system == "zero3_offload" else 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": cuda},
            "overlap_comm": True,
            "contiguous_gradients": True,
        }
        if system == "zero3_offload":
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    return config


def same_initial_weights(model, gathered=None) -> None:
    """Fill every parameter from a generator seeded by its name: the same initial weights in
    every system, whatever order or partitioning it builds them in. Norm weights are ones,
    every other parameter normal with Hugging Face's std (its Llama init, seeded per name).

    ``gathered(param)``: a context in which the parameter is whole and writable (ZeRO-3's
    ``GatheredParameters``: one parameter at a time, so no rank ever holds the model whole)."""
    import contextlib

    import torch

    for name, param in model.named_parameters():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if "norm" in name:
            values = torch.ones(shape)
        else:
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            values = torch.empty(shape).normal_(0.0, INIT_STD, generator=generator)
        with gathered(param) if gathered is not None else contextlib.nullcontext(), torch.no_grad():
            param.copy_(values)


def _build(system: str, args: argparse.Namespace, cuda: bool, trace: Path | None):
    """``(engine or model, plain optimizer or None, params)`` for ``system``, from the same weights."""
    import deepspeed
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 128),
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    if system == "zero3_offload":
        ds_config = _ds_config(system, args, cuda)
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = transformers.LlamaForCausalLM(config)
        same_initial_weights(model, lambda p: deepspeed.zero.GatheredParameters([p], modifier_rank=0))
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
        return engine, None, sum(p.ds_numel for p in model.parameters())
    model = transformers.LlamaForCausalLM(config)
    same_initial_weights(model)
    params = sum(p.numel() for p in model.parameters())
    if system in ENGINE_SYSTEMS or system in DEEPSPEED_SYSTEMS:
        ds_config = _ds_config(system, args, cuda, trace)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
        return engine, None, params
    device = torch.device("cuda" if cuda else "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)
    return model.to(device), optimizer, params


def run_child(system: str, args: argparse.Namespace) -> dict:
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29541",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        os.environ.setdefault(key, value)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import megatrain_ds  # noqa: F401  (routes "engine": "megatrain")

    trace = Path(tempfile.mkdtemp()) / "trace.json" if system in ENGINE_SYSTEMS else None
    decisions = PlacementDecisions.attach()  # before the engine is built, which logs them
    baseline = _rss_bytes()
    started = time.perf_counter()
    engine, optimizer, params = _build(system, args, cuda, trace)
    init_seconds = time.perf_counter() - started
    phases, losses = _train(system, engine, optimizer, args, cuda)
    measured = phases[args.warmup :]
    median = sorted(measured, key=lambda t: t["step"])[len(measured) // 2]
    tokens = args.micro_batch * args.seq_len
    result = {
        "params": params,
        "step_seconds": median["step"],
        "forward_seconds": median["forward"],
        "backward_seconds": median["backward"],
        "optimizer_seconds": median["optimizer"],
        "warmup_steps": args.warmup,
        "all_step_seconds": [t["step"] for t in phases],
        # CPU seconds of every thread of the process: less sensitive than wall time to
        # other processes on a shared machine (but it counts OpenMP threads spinning).
        "cpu_seconds": median["cpu"],
        "all_cpu_seconds": [t["cpu"] for t in phases],
        "tokens_per_s": tokens / median["step"],
        "tflops_6pt": 6 * params * tokens / median["step"] / 1e12,
        "recompute_tflops": (2 * params * tokens / median["step"] / 1e12) if system == "megatrain" else 0.0,
        "init_seconds": init_seconds,
        "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "baseline_rss_bytes": baseline,
        "losses": losses,
        "first_loss": losses[0],
    }
    result["bytes_per_param"] = result["peak_host_bytes"] / params
    result["device_idle_seconds"] = None
    if system == "megatrain_no_recompute":
        result.update(_stash_figures(engine, engine.module, args))
    if system in ENGINE_SYSTEMS:
        assert trace is not None
        result["optimizer_placement"] = {**_placement_of(engine), "decision": decisions.messages}
        result.update(_nvme_figures(engine))
        engine.destroy()  # writes the trace, should its last step not have
        idle = _device_idle_seconds(trace)[-len(measured) :]
        splits = _step_splits(trace)[-len(measured) :]
        shutil.rmtree(trace.parent, ignore_errors=True)
        if len(idle) == len(measured):  # the last traced steps are the measured ones, in order
            result["device_idle_seconds"] = idle[measured.index(median)]
            result["trace_split"] = splits[measured.index(median)]
        result["block_params"] = sum(p.numel() for p in engine.module.model.layers.parameters())
    return result


def _train(system: str, engine, optimizer, args: argparse.Namespace, cuda: bool) -> tuple[list[dict], list[float]]:
    """Warm-up and measured steps on the same batches for every system: per step its phases'
    seconds (device work waited for at each phase's end) and the loss."""
    import torch

    device = torch.device("cuda" if cuda else "cpu")
    generator = torch.Generator().manual_seed(1)
    phases: list[dict[str, float]] = []
    losses = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=generator).to(device)
        c0 = time.process_time()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and system == "torch"):
            loss = engine(input_ids=ids, labels=ids).loss
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if optimizer is not None:
            loss.backward()
        else:
            engine.backward(loss)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if optimizer is not None:
            if args.clip:
                torch.nn.utils.clip_grad_norm_(engine.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        phases.append(
            dict(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2, step=t3 - t0, cpu=time.process_time() - c0)
        )
        losses.append(float(loss))
    return phases, losses


class PlacementDecisions(logging.Handler):
    """The engine's logged placement decisions (``"optimizer_device"``, ``optimizer/placement.py``;
    ``"device_state"``, ``config/engine_config.py``, ``engine_build.py`` and
    ``optimizer_build.py``; the update's finish, pipelined or why not,
    ``optimizer/pipelined_finish.py``): each with the reason or the measured rates it was
    made from, which the placement's counts alone do not give."""

    LOGGER = "megatrain_ds"
    """The package's logger, not the modules' own: a decision's log line moves with its code
    (the GPU tier's moved from ``engine_build.py`` to ``optimizer_build.py``), and a handler
    on the old module's logger would then miss it without a word. Its messages' prefixes
    pick the decisions out."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    @classmethod
    def attach(cls) -> PlacementDecisions:
        handler = cls()
        logger = logging.getLogger(cls.LOGGER)
        # INFO reaches the handler; the root logger's last-resort handler still prints only
        # warnings, so the round's output is no louder.
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        logger.addHandler(handler)
        return handler

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(("megatrain: optimizer", "megatrain: device_state")):
            self.messages.append(message)


def _placement_of(engine) -> dict:
    """Where the engine's optimizer ran each state: the ``"auto"`` placement's decision."""
    adamw = engine.adamw
    on_device = engine.placement.device_indices  # the GPU tier ("device_state"): stepped in place there
    where = [
        "DeviceStates" if index in on_device else type(adamw.placement_of(state)).__name__
        for index, state in enumerate(engine.optimizer_states)
    ]
    # Elements per kernel too: the planner's ``device_optimizer_share`` is the device's
    # share of them (planning/step_time.py), which state counts alone do not give.
    numels = [state.layout.numel for state in engine.optimizer_states]
    return {
        "setting": engine.config.options.optimizer_device,
        "device_state": {
            "setting": engine.config.options.device_state,
            "states": len(on_device),
            "elements": sum(engine.states[index].layout.numel for index in on_device),
            "device_bytes": sum(engine.placement.device_bytes().values()),
        },
        "states": len(where),
        "by_kernel": {name: where.count(name) for name in sorted(set(where))},
        "elements_by_kernel": {
            name: sum(n for n, kernel in zip(numels, where) if kernel == name) for name in sorted(set(where))
        },
    }


def _nvme_figures(engine) -> dict:
    tier = engine.nvme_tier
    if tier is None:
        return {}
    nvme = {
        "engine": tier.engine_name,
        "swap_bytes": tier.directory.nbytes,
        "window_bytes": tier.window_bytes,
        "bytes_read": tier.bytes_read,
        "bytes_written": tier.bytes_written,
        "kinds": list(tier.kinds),
    }
    if engine.nvme_weights is not None:
        nvme.update(weight_window_bytes=engine.nvme_weights.nbytes, weight_reads=engine.nvme_weights.reads)
    return {"nvme": nvme}


def _stash_figures(engine, model, args: argparse.Namespace) -> dict:
    """What the engine's stash held per block (each saved storage once), and the planner's
    estimate of it for this model and batch."""
    from megatrain_ds.cli import shape_of
    from megatrain_ds.planning.planner import RunSettings, stash_bytes_per_block

    measured = engine.blocks.stash.block_bytes
    settings = RunSettings(seq_len=args.seq_len, micro_batch=args.micro_batch, bf16=engine.config.bf16)
    predicted = stash_bytes_per_block(shape_of(model), settings)
    per_block = sum(measured.values()) / len(measured)
    return {
        "stashed_blocks": len(measured),
        "stash_bytes_per_block": per_block,
        "predicted_stash_bytes_per_block": predicted,
        "stash_predicted_over_measured": predicted / per_block,
        "stash_peak_host_bytes": engine.blocks.stash.peak_host_bytes,
    }


def _device_idle_seconds(trace: Path) -> list[float]:
    """Per traced step: its length less the union of its compute-track spans (seconds)."""
    from timeline import busy_ms, load_spans, steps_in

    if not trace.exists():
        return []
    spans, _ = load_spans(trace)
    idle = []
    for step in steps_in(spans):
        mine = [s for s in spans if s["args"].get("step") == step]
        length = sum(s["end_ms"] - s["start_ms"] for s in mine if s["track"] == "step")
        idle.append((length - busy_ms([s for s in mine if s["track"] == "compute"])) / 1e3)
    return idle


def _step_splits(trace: Path) -> list[dict[str, float]]:
    """Per traced step: seconds of compute (union of the compute track), of the training
    threads waiting for the NVMe tier ("nvme wait"), of AdamW ranges ("optimizer worker"
    spans named adamw), and of swap reads and writes (their I/O threads)."""
    from timeline import busy_ms, load_spans, steps_in

    if not trace.exists():
        return []
    spans, _ = load_spans(trace)
    splits = []
    for step in steps_in(spans):
        mine = [s for s in spans if s["args"].get("step") == step]

        def total(track: str, prefix: str = "") -> float:
            return (
                sum(
                    s["end_ms"] - s["start_ms"]
                    for s in mine
                    if s["track"] == track and s.get("name", "").startswith(prefix)
                )
                / 1e3
            )

        splits.append(
            {
                "step": total("step"),
                "compute": busy_ms([s for s in mine if s["track"] == "compute"]) / 1e3,
                "disk_wait": total("nvme wait"),
                "optimizer": total("optimizer worker", "adamw"),
                "disk_read": total("nvme read"),
                "disk_write": total("nvme write"),
            }
        )
    return splits


def _seconds_or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mem_available() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def run_guarded(command: list[str], min_free: int) -> tuple[subprocess.CompletedProcess, int]:
    """Run a child; kill it (and say so in its stderr) should MemAvailable fall under
    ``min_free``: ZeRO-3 offload needs ~40 B/param, and the machine may be shared -- no run
    may bring on the OOM killer. Returns the run and the lowest MemAvailable seen."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = threading.Event()
    lowest = [_mem_available()]

    def watch() -> None:
        while child.poll() is None:
            lowest[0] = min(lowest[0], _mem_available())
            if lowest[0] < min_free:
                killed.set()
                child.kill()  # our own child, by its handle
                return
            time.sleep(0.1)

    watchdog = threading.Thread(target=watch, daemon=True)
    watchdog.start()
    stdout, stderr = child.communicate()
    watchdog.join()
    if killed.is_set():
        stderr += f"\nkilled: MemAvailable fell under {min_free / 2**30:.2f} GiB"
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr), lowest[0]


def _device_shares(result: dict) -> tuple[float, float]:
    """Of the round's optimizer state elements: the share the GPU tier kept on the device
    (``"device_state"``, the planner's ``--device-state``), and of the rest the share the
    engine streamed through the device (its ``"auto"`` or ``"gpu"`` placement, the planner's
    ``--optimizer-device-share``)."""
    elements = result.get("optimizer_placement", {}).get("elements_by_kernel", {})
    total = sum(elements.values())
    tier = elements.get("DeviceStates", 0)
    rest = total - tier
    return (tier / total if total else 0.0), (elements.get("DeviceAdamW", 0) / rest if rest else 0.0)


PLANNER_TIMEOUT_S = 300
"""Seconds a ``megatrain plan`` call may take (a probe takes seconds, the imports tens):
one that hangs (a DeepSpeed op's stale build lock, CONTRIBUTING.md) costs this much of a
GPU session's minutes, and its failure is recorded, not the benchmark's end."""


class PlannerFailed(Exception):
    """``megatrain plan`` gave no prediction: the reason goes into the round's
    ``planner_error`` and the benchmark goes on with the next system."""


def run_planner(
    args: argparse.Namespace, shares: tuple[float, float] = (0.0, 0.0), figures: str = "measure", stashed: int = 0
) -> dict:
    """``megatrain plan --json`` for the benchmark's model and batch (fresh process); raises
    :class:`PlannerFailed` where the planner has no figures for this device, fails, hangs or
    prints no JSON. ``shares``: of the optimizer
    state, the GPU tier's share and, of the rest, the share the engine steps on the device
    (:func:`_device_shares`). ``figures``: ``"measure"`` (``--probe`` on a GPU, the CPU
    profile measured again on the CPU: the machine as it is for this round), ``"declared"``
    (no measurement: the GPU table's figures, or the cached CPU profile; what the floor of a
    ``--no-planner`` run takes), or the path of a JSON file holding a plan's ``hardware``
    (``megatrain plan --hardware``: the figures an earlier call measured). ``stashed``: the
    blocks the round stashed instead of recomputing."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().upper()
        gpu = next(
            (key for marker, key in (("GH200", "gh200"), ("H200", "h200"), ("H100", "h100")) if marker in name), None
        )
        if gpu is None:
            raise PlannerFailed(f"no figures for {torch.cuda.get_device_name()} (GPU_HARDWARE)")
    else:
        gpu = "cpu"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "config.json")
        path.write_text(json.dumps(_llama_config(args)))
        command = [sys.executable, "-m", "megatrain_ds.cli", "plan", "--model", str(path), "--gpu", gpu]
        command += ["--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--json"]
        command += ["--device-state", str(shares[0]), "--optimizer-device-share", str(shares[1])]
        command += ["--stashed-blocks", str(stashed)]
        if not args.clip:
            command.append("--no-clipping")
        if figures == "measure":
            # On a GPU: this machine's host AdamW and copy rates and a block on the device.
            command.append("--recalibrate" if gpu == "cpu" else "--probe")
        elif figures != "declared":
            command += ["--hardware", figures]
        try:
            completed = subprocess.run(command, capture_output=True, text=True, timeout=PLANNER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise PlannerFailed(f"no answer in {PLANNER_TIMEOUT_S} s: {' '.join(command[3:])}") from None
    if completed.returncode != 0:
        raise PlannerFailed(f"exit {completed.returncode}: {completed.stderr[-2000:]}")
    try:
        return json.loads(completed.stdout)
    except json.JSONDecodeError as error:
        raise PlannerFailed(f"not JSON ({error}): {completed.stdout[-500:]}") from None


def _llama_config(args: argparse.Namespace) -> dict:
    """The benchmark's model as a Hugging Face config.json (what :func:`_build` builds)."""
    return {
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate or args.hidden * 8 // 3 // 64 * 64,
        "num_hidden_layers": args.layers,
        "num_attention_heads": max(1, args.hidden // 128),
        "num_key_value_heads": max(1, args.hidden // 128),
        "attn_implementation": "sdpa",
    }


def add_planner_figures(result: dict, args: argparse.Namespace, figures_file: Path) -> None:
    """The planner's floor for an engine round, whatever ``--no-planner`` says, and with the
    planner on its prediction too. The floor is arithmetic over the rates: with the planner
    on, those measured by the first engine round's planner call (saved to ``figures_file``
    and reused by the later rounds, so every system is judged by the same figures); with
    ``--no-planner``, the declared ones (no probe: the GPU table's, or the cached CPU
    profile), as ``floor_figures`` says."""
    shares, stashed = _device_shares(result), result.get("stashed_blocks", 0)
    reuse = figures_file.exists()
    figures = "declared" if args.no_planner else str(figures_file) if reuse else "measure"
    # A measuring call that failed is not tried again: one that hung would cost every round
    # PLANNER_TIMEOUT_S of a GPU session's minutes.
    measure_failed = figures_file.with_name("measuring_failed.txt")
    if figures == "measure" and measure_failed.exists():
        result["planner_error"] = f"not run: an earlier round's measuring call failed ({measure_failed.read_text()})"
        return
    try:
        prediction = run_planner(args, shares, figures=figures, stashed=stashed)
    except PlannerFailed as failure:
        print(f"planner: failed: {failure}")
        result["planner_error"] = str(failure)  # in the JSON: the round's numbers stand without it
        if figures == "measure":
            measure_failed.write_text(str(failure)[:500])
        return
    if args.no_planner:
        _add_floor(result, prediction, "declared")
        _add_block_rate_in_run(result, args, prediction["hardware"])  # beside the declared 1.0 on a GPU
        return
    if not reuse:
        keep = {"hardware": prediction["hardware"], "hardware_sources": prediction.get("hardware_sources")}
        figures_file.write_text(json.dumps(keep))
    _add_prediction(result, prediction)
    _add_floor(result, prediction, "measured")
    _add_block_rate_in_run(result, args, prediction["hardware"])


def _add_block_rate_in_run(result: dict, args: argparse.Namespace, hardware: dict) -> None:
    """The blocks' efficiency the run itself reached, by the probe's definition (``8 P_b T``
    FLOPs, less the recompute of stashed blocks, over ``flops`` and the time): from the
    union of its compute-track spans (forward, recompute and backward of every block,
    ``trace_split.compute``), beside the probe's ``block_efficiency``. Their ratio is what
    the probe of a bare block misses of the engine's way of running it (issue 42, item 5:
    1.3-1.7x in the H200 runs); on the CPU the spans also hold the gradient path's host
    work, which the CPU model times apart."""
    compute = result.get("trace_split", {}).get("compute")
    if not compute or "block_params" not in result:
        return
    tokens, blocks = args.micro_batch * args.seq_len, result["block_params"]
    # Stashed blocks (megatrain_no_recompute) are not recomputed: 2 P T fewer each.
    flops = (8 * blocks - 2 * result.get("stashed_blocks", 0) * blocks / args.layers) * tokens
    in_run = flops / hardware["flops"] / compute
    result["block_efficiency_in_run"] = in_run
    result["block_efficiency_probe_over_run"] = hardware["block_efficiency"] / in_run


def _add_floor(result: dict, prediction: dict, figures: str) -> None:
    """The floor: the largest single bound of the planner's model (compute, the weight and
    gradient copies, the optimizer pass), i.e. the step if everything else hid; with the
    figures it came from (``"measured"`` in this run, or ``"declared"``) and each bound."""
    result["floor_seconds"] = max(prediction["step_seconds_by_bound"].values())
    result["step_over_floor"] = result["step_seconds"] / result["floor_seconds"]
    result["floor_by_bound"] = prediction["step_seconds_by_bound"]
    result["floor_figures"] = figures
    result["floor_hardware"] = prediction.get("hardware")
    result["floor_hardware_sources"] = prediction.get("hardware_sources")


def _add_prediction(result: dict, prediction: dict) -> None:
    """The planner's figures next to the engine's measured ones (ratios: predicted / measured)."""
    params = result["params"]
    result["predicted_step_seconds"] = prediction["predicted_step_seconds"]
    result["predicted_tokens_per_s"] = prediction["predicted_tokens_per_second"]
    result["predicted_peak_host_bytes"] = prediction["predicted_peak_host_bytes"]
    result["predicted_bytes_per_param"] = prediction["predicted_peak_host_bytes"] / params
    result["predicted_over_measured"] = {
        "step_seconds": prediction["predicted_step_seconds"] / result["step_seconds"],
        "tokens_per_s": prediction["predicted_tokens_per_second"] / result["tokens_per_s"],
        "peak_host_bytes": prediction["predicted_peak_host_bytes"] / result["peak_host_bytes"],
    }
    result["predicted_by_part"] = prediction["step_seconds_by_bound"]
    result["predicted_by_phase"] = prediction.get("step_seconds_by_phase")
    # The planner's inputs, so a later check can run the planner again on the same figures
    # (tests/test_planner_gpu_runs.py): the hardware measured by --probe and the run's settings.
    result["planner_hardware"] = prediction.get("hardware")
    result["planner_hardware_sources"] = prediction.get("hardware_sources")  # measured, the table's, not probed
    result["planner_settings"] = prediction.get("settings")


def _versions() -> dict:
    import importlib.metadata as metadata

    def version(name: str) -> str:
        # A checkout run without `pip install` (the GPU machines) has no megatrain_ds metadata.
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {name: version(name) for name in ("torch", "deepspeed", "transformers", "megatrain_ds")}


def _json_object(text: str) -> dict:
    """``--megatrain``'s value: a JSON object, or an error naming what it got."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'a JSON object is needed, e.g. \'{{"optimizer_device": "cpu"}}\'; got {text!r}'
        )
    return value


def _git_rev() -> str:
    """The checkout's commit, or "unknown" where the tree was copied without git."""
    try:
        return (
            subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    """The benchmark's arguments (``--child`` is the round a fresh process runs)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=3, help="steps run before the measured ones (at least 1)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps: their median is reported")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every system; the median round is kept")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--no-planner", action="store_true", help="skip the planner's prediction")
    parser.add_argument(
        "--min-free",
        type=float,
        default=0.5,
        help="GiB of MemAvailable under which a run is killed (the machine may be shared)",
    )
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/compare_<device>_<params>.json)")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute on the CPU too (always on with CUDA)")
    parser.add_argument(
        "--nvme-buffer-count",
        type=int,
        default=4,
        help="offload_optimizer.buffer_count: blocks in the NVMe tier's host window",
    )
    parser.add_argument(
        "--nvme-path",
        default=None,
        help="the engine's optimizer state on NVMe here (a ZeRO-Infinity offload_optimizer block)",
    )
    parser.add_argument(
        "--nvme-weights",
        action="store_true",
        help='with --nvme-path: the weights there too (offload_param.device "nvme")',
    )
    parser.add_argument(
        "--megatrain",
        type=_json_object,
        default={},
        help='more of the engine\'s "megatrain" block, as JSON (e.g. \'{"optimizer_device": "cpu"}\')',
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the issue's fair comparison: 3 and 5 or more)")
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, args)))
        return

    passthrough = [arg for arg in sys.argv[1:]]
    figures_file = Path(tempfile.mkdtemp()) / "planner_hardware.json"  # the first planner call's figures
    best: dict[str, dict] = {}  # per system, its median round
    rounds: dict[str, list[dict]] = {system: [] for system in args.systems}
    for _ in range(args.repeats):
        for system in args.systems:
            completed, _ = run_guarded(
                [sys.executable, __file__, *passthrough, "--child", system], int(args.min_free * 2**30)
            )
            lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
            if completed.returncode != 0 or not lines:
                print(f"{system}: failed (exit {completed.returncode}): {completed.stderr[-2000:]}")
                continue
            result = json.loads(lines[-1][len("RESULT ") :])
            rounds[system].append(result)
            if system in ENGINE_SYSTEMS:  # the floor always; the prediction with the planner on
                add_planner_figures(result, args, figures_file)
            # The median round (the upper one of two): no system is credited with its luckiest round.
            best[system] = sorted(rounds[system], key=lambda r: r["step_seconds"])[len(rounds[system]) // 2]
            # Written after every system, so that a run cut off by its time limit keeps what it has.
            report(args, best, rounds)
    shutil.rmtree(figures_file.parent, ignore_errors=True)


def report(args: argparse.Namespace, best: dict[str, dict], rounds: dict[str, list[dict]]) -> None:
    """Print the table of the median rounds so far and write them with their ratios as JSON."""
    print(
        f"{'system':34s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'step s':>8s} {'fwd':>6s} {'bwd':>6s} "
        f"{'opt':>6s} {'idle':>6s} {'host B/param':>12s} {'GPU GiB':>8s}"
    )
    for system, r in best.items():
        print(
            f"{RESULT_KEY[system]:34s} {r['tokens_per_s']:10.1f} {r['tflops_6pt']:8.4f} {r['step_seconds']:8.2f} "
            f"{r['forward_seconds']:6.2f} {r['backward_seconds']:6.2f} {r['optimizer_seconds']:6.2f} "
            f"{_seconds_or_dash(r.get('device_idle_seconds')):>6s} "
            f"{r['bytes_per_param']:12.2f} {r['peak_gpu_bytes'] / 2**30:8.2f}"
        )
    comparisons = {}
    if "megatrain" in best and "megatrain_no_recompute" in best:
        full, stash = best["megatrain"], best["megatrain_no_recompute"]
        comparisons["recompute_none_over_full_step"] = stash["step_seconds"] / full["step_seconds"]
        # The stash's cost in the process's own memory: the peak RSS difference per block.
        comparisons["rss_bytes_per_stashed_block"] = (stash["peak_host_bytes"] - full["peak_host_bytes"]) / stash[
            "stashed_blocks"
        ]
        comparisons["rss_per_block_over_planner"] = (
            comparisons["rss_bytes_per_stashed_block"] / stash["predicted_stash_bytes_per_block"]
        )
        print(
            f"recompute none / full step time: {comparisons['recompute_none_over_full_step']:.3f} "
            f"({stash['step_seconds']:.2f} s vs {full['step_seconds']:.2f} s)"
        )
        print(
            f"stash per block: {stash['stash_bytes_per_block'] / 2**20:.1f} MiB held by the engine, "
            f"{comparisons['rss_bytes_per_stashed_block'] / 2**20:.1f} MiB by peak RSS, planner "
            f"{stash['predicted_stash_bytes_per_block'] / 2**20:.1f} MiB (planner / held: "
            f"{stash['stash_predicted_over_measured']:.3f})"
        )
    if "megatrain" in best and "megatrain_host_state" in best:
        tier = best["megatrain"]  # the default, "device_state": "auto"
        ratio = tier["tokens_per_s"] / best["megatrain_host_state"]["tokens_per_s"]
        comparisons["device_state_auto_over_none_tokens_per_s"] = ratio
        placed = tier["optimizer_placement"]["device_state"]
        print(
            f"device_state auto / none tokens/s: {ratio:.2f}x ({placed['states']} states, "
            f"{placed['device_bytes'] / 2**30:.1f} GiB on the device)"
        )
    if "megatrain" in best:
        for other in ("zero3_offload", "zero2_offload", "torch"):
            if other in best:
                ratio = best["megatrain"]["tokens_per_s"] / best[other]["tokens_per_s"]
                comparisons[f"megatrain_tokens_per_s_over_{RESULT_KEY[other]}"] = ratio
                print(f"megatrain tokens/s / {RESULT_KEY[other]}: {ratio:.2f}x")
    first = {RESULT_KEY[s]: r["first_loss"] for s, r in best.items()}
    comparisons["first_losses"] = first  # the same initial weights: these agree to the compute dtype
    print("first-step loss: " + ", ".join(f"{name} {loss:.4f}" for name, loss in first.items()))
    for system in (s for s in ENGINE_SYSTEMS if s in best):
        mt = best[system]
        if "predicted_step_seconds" in mt:
            ratio = mt["predicted_over_measured"]
            print(
                f"planner, {RESULT_KEY[system]}: step {mt['predicted_step_seconds']:.3f} s predicted vs "
                f"{mt['step_seconds']:.3f} s measured ({ratio['step_seconds']:.2f}x); peak host "
                f"{mt['predicted_bytes_per_param']:.2f} vs {mt['bytes_per_param']:.2f} B/param "
                f"({ratio['peak_host_bytes']:.2f}x)"
            )
        if "floor_seconds" in mt:
            print(
                f"floor, {RESULT_KEY[system]}: {mt['floor_seconds']:.3f} s ({mt['floor_figures']} figures), "
                f"step / floor {mt['step_over_floor']:.2f}"
            )
    import torch

    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    )
    params = next(iter(best.values()))["params"] if best else 0
    out = Path(args.out or f"bench/results/compare_{device.split()[0].lower()}_{params // 10**6}M.json")
    rev = _git_rev()
    out.write_text(
        json.dumps(
            {
                "device": device,
                "git_rev": rev,
                "versions": _versions(),
                "model": {
                    "hidden": args.hidden,
                    "intermediate": args.intermediate,
                    "layers": args.layers,
                    "vocab": args.vocab,
                    "params": params,
                },
                "batch": {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "gradient_clipping": args.clip},
                "steps": {"warmup": args.warmup, "measured": args.steps, "reported": "median"},
                "megatrain_options": args.megatrain,
                "results": {RESULT_KEY[s]: r for s, r in best.items()},
                "comparisons": comparisons,
                "rounds": {
                    RESULT_KEY[s]: [
                        {
                            k: r[k]
                            for k in (
                                "step_seconds",
                                "all_step_seconds",
                                "all_cpu_seconds",
                                "bytes_per_param",
                                "predicted_step_seconds",
                            )
                            if k in r
                        }
                        for r in runs
                    ]
                    for s, runs in rounds.items()
                },
                "load_average_at_end": os.getloadavg(),
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
