"""``megatrain`` console script. ``megatrain plan`` prints the cost model of a run.

    megatrain plan --model DIR_OR_CONFIG_JSON --gpu h100|h200|gh200|cpu \\
        --host-memory 1536GB --seq-len 4096 --micro-batch 1 [--json]

The model is built on the meta device (no memory) from a Hugging Face model directory or
a ``config.json`` (with ``model_type``), so its blocks are found exactly as the engine
finds them. ``--gpu cpu`` plans a run whose device is this machine's CPU: it measures
the model's own matmul shapes, one real block, memory copies and the engine's AdamW here
first, and caches the figures (:func:`cpu_profile`; ``--recalibrate`` measures again).
``--probe`` with a GPU target measures this machine instead of the table's typical one
(the engine's CPU AdamW past the caches, memory copies and, with a CUDA device, its pinned
copies and a real block of the model: run it on the machine that will train).
``--nvme PATH`` plans the NVMe tier with its swap files under ``PATH``: the disk's
sequential O_DIRECT bandwidth there is measured once and cached the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from megatrain_ds.model.block_discovery import find_blocks
from megatrain_ds.planning import hardware_figures
from megatrain_ds.planning.host_probe import AdamWork, adam_work, fastest_seconds, probe_adam
from megatrain_ds.planning.long_context import choose_mlp_tile_tokens, ffn_width
from megatrain_ds.planning.planner import (
    GIB,
    GPU_HARDWARE,
    Hardware,
    ModelShape,
    RunSettings,
    auto_device_state_share,
    plan,
    sizes_from_config,
)
from megatrain_ds.planning.step_time import stepped_block_params
from megatrain_ds.runtime.measurement_cache import cached_measurement
from megatrain_ds.state.swap_io import cached_disk_bandwidth

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"1536GB"``, ``"24GiB"``, ``"512G"`` -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 1536GB)")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])


def shape_of(model: torch.nn.Module, block_path: str | None = None) -> ModelShape:
    """The planner's view of ``model`` (meta tensors are fine: only sizes are read)."""
    _, blocks = find_blocks(model, block_path)
    block_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    frozen_sizes = [sum(p.numel() for p in block.parameters() if not p.requires_grad) for block in blocks]
    block_ids = {id(p) for block in blocks for p in block.parameters()}
    resident = sum(p.numel() for p in model.parameters() if id(p) not in block_ids)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    largest = blocks[block_sizes.index(max(block_sizes))]
    return ModelShape(
        num_blocks=len(blocks),
        block_params=max(block_sizes),
        total_block_params=sum(block_sizes),
        resident_params=resident,
        frozen_params=sum(p.numel() for p in frozen),
        frozen_block_params=sum(p.numel() for p in largest.parameters() if not p.requires_grad),
        frozen_resident_params=sum(p.numel() for p in frozen if id(p) not in block_ids),
        frozen_in_bf16=bool(frozen) and all(p.dtype == torch.bfloat16 for p in frozen),
        # Blocks that differ (LoRA on some layers, blocks frozen whole) are planned one by one.
        block_sizes=tuple(zip(block_sizes, frozen_sizes)) if len(set(zip(block_sizes, frozen_sizes))) > 1 else (),
        **{
            **sizes_from_config(getattr(model, "config", None)),
            # the blocks' own MLP width (one expert's, for stacked experts)
            "intermediate": max(ffn_width(block) for block in blocks),
        },
    )


def load_meta_model(source: str) -> torch.nn.Module:
    """A causal LM with the architecture of ``source`` (directory or config JSON), on meta."""
    import transformers

    path = Path(source)
    if path.is_dir():
        config = transformers.AutoConfig.from_pretrained(path)
    elif path.is_file():
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ValueError(f'{source}: a config JSON needs a model_type key (e.g. "llama")')
        config = transformers.AutoConfig.for_model(**data)
    else:
        raise ValueError(f"--model {source!r} is neither a model directory nor a config JSON file")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def measure_cpu(seconds: float = 0.5) -> Hardware:
    """This machine as the compute device, model-independent: a 1024^3 fp32 matmul and a
    128 MB memory copy (:func:`cpu_profile` measures a model's own shapes instead)."""
    size = 1024
    a, b = torch.randn(size, size), torch.randn(size, size)
    flops = 2 * size**3 / fastest_seconds(lambda: a @ b, seconds)
    source = torch.empty(32 << 20)
    target = torch.empty_like(source)
    copy_rate = source.numel() * 4 / fastest_seconds(lambda: target.copy_(source), seconds)
    # Copies move bytes once each way: read+write traffic is twice the copy rate.
    return Hardware("cpu", flops, copy_rate, copy_rate, 2 * copy_rate, physical_memory(), shares_host_memory=True)


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# -- the CPU profile of one model ------------------------------------------------------------

CPU_PROFILE_MAX_TOKENS = 1024
"""Tokens the CPU profile measures a block at, at most (a block's efficiency is flat past
a few hundred tokens; attention's share at longer sequences is then underestimated)."""
_PROFILE_VOCAB = 256
_HEAD_COLUMNS = 8192
"""The lm_head's matmul is timed on this many vocabulary rows (the rate is flat beyond)."""


def cpu_profile(
    config: Any,
    block_path: str,
    settings: RunSettings,
    recalibrate: bool = False,
    cache: Path | None = None,
    seconds: float = 0.3,
) -> Hardware:
    """This machine as the device for ``config``'s model at ``settings``' tokens, measured
    once and cached per machine, model shape and tokens (``--recalibrate`` measures again).
    ``block_path`` names the model's block list (``block_discovery.find_blocks``).

    - ``flops``, ``head_flops``: the matmul rate at the model's own linear shapes (a block's
      weight shapes, weighted by FLOPs; the lm_head's), forward, input-gradient and
      weight-gradient matmuls at the run's tokens;
    - ``block_efficiency``: one real block of the model (a one-layer model built from
      ``config`` with a tiny vocabulary, its MLP in the engine's tiles), forward without
      grad and then forward and backward, as the engine runs it, against
      ``8 * P_b * T / flops``;
    - ``host_memory_bytes_per_s``: a 256 MB copy (past the caches), read + write;
    - ``adam_bytes_per_s``: the engine's CPU AdamW kernel making the run's pass
      (``planning/host_probe.py``: its gradient dtype and clipping scale, on a worker
      thread, a block's state per call) on states ``ADAM_PROBE_CACHE_MULTIPLE`` times the
      last-level cache (past the caches, as a model's are: 4M elements under a 32 MB L3
      looked 3x faster here, 16M under the H200 host's 3.3x).
    Each figure is the fastest of repeated runs: load from other processes only slows a run.
    """
    from megatrain_ds.optimizer.placement import cache_path

    path = cache or cache_path().with_name("cpu_profile.json")
    tokens = min(settings.tokens_per_pass, CPU_PROFILE_MAX_TOKENS)
    seq_len = min(settings.seq_len, tokens)
    dtype = torch.bfloat16 if settings.bf16 else torch.float32
    key = "|".join(
        [
            socket.gethostname(),
            platform.processor() or platform.machine(),
            str(os.cpu_count()),
            str(torch.get_num_threads()),
            torch.__version__,
            str(dtype),
            # Profiles measured before the probe ran AdamW as the run does are stale.
            "adam as run: {0.grad_dtype} gradient, shadow {0.shadow}, scale {0.grad_scale}".format(
                adam_work(settings, 1, 0)
            ),
            f"mlp tiled: {settings.tiled_mlp}",
            f"{seq_len}x{tokens // seq_len}",
            json.dumps(_shape_signature(config), sort_keys=True),
        ]
    )
    profiled = dataclasses.replace(settings, seq_len=seq_len, micro_batch=tokens // seq_len)
    figures = cached_measurement(
        path, key, lambda: _measure_profile(config, block_path, profiled, dtype, seconds), recalibrate
    )
    return Hardware(
        "cpu",
        figures["flops"],
        figures["copy_bytes_per_s"],
        figures["copy_bytes_per_s"],
        2 * figures["copy_bytes_per_s"],
        physical_memory(),
        shares_host_memory=True,
        block_efficiency=figures["block_efficiency"],
        adam_bytes_per_s=figures["adam_bytes_per_s"],
        head_flops=figures["head_flops"],
    )


def _shape_signature(config: Any) -> dict[str, Any]:
    keep = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "n_embd",
        "n_head",
        "n_inner",
        "tie_word_embeddings",
    )
    return {k: getattr(config, k) for k in keep if isinstance(getattr(config, k, None), (int, str, bool))}


def _copy_bytes_per_s(seconds: float) -> float:
    """Host memory copy bandwidth over a 256 MiB buffer (freed on return)."""
    source = torch.empty(64 << 20)
    target = torch.empty_like(source)
    return source.numel() * 4 / fastest_seconds(lambda: target.copy_(source), seconds)


def probe_host(
    hardware: Hardware, adam: AdamWork, block: Callable[[Hardware], float] | None = None, seconds: float = 0.3
) -> Hardware:
    """``--probe``: a GPU machine's figures with its host measured here, on the machine that
    will train (planning/step_time.py: [Note: a step's phases]), instead of the table's
    typical host: the memory copy rate, and the engine's CPU AdamW kernel making ``adam``'s
    pass as the run makes it (``planning/host_probe.py``: [Note: probing AdamW as the run
    runs it]). With a CUDA device here also the same pass beside pinned copies both ways
    (the optimizer behind backward when no gradient is held), the pinned copy rates each
    way, and ``block`` (a real block of the model on the device,
    :func:`device_block_efficiency`) for the block efficiency. Without one those keep the
    table's figures, and the AdamW rate beside copies stays 0 (not probed: the rate alone
    stands in, and ``hardware_figures.figure_sources`` says so)."""
    from megatrain_ds.runtime.device_runtime import DeviceRuntime, cuda_available

    runtime = DeviceRuntime.create(torch.device("cuda")) if cuda_available() else None
    copy_rate = _copy_bytes_per_s(seconds)
    rates = probe_adam(adam, seconds, runtime)
    # Copies move bytes once each way: read+write traffic is twice the copy rate.
    measured = dataclasses.replace(
        hardware,
        host_memory_bytes_per_s=2 * copy_rate,
        adam_bytes_per_s=rates.adam_bytes_per_s,
        adam_beside_copies_bytes_per_s=rates.adam_beside_copies_bytes_per_s,
    )
    if runtime is None:  # planning a GPU from a machine without one
        return measured
    link = runtime.measure_copy_rates(256 << 20)
    assert link is not None  # a CUDA runtime copies
    measured = dataclasses.replace(measured, h2d_bytes_per_s=link[0], d2h_bytes_per_s=link[1])
    return dataclasses.replace(measured, block_efficiency=block(measured)) if block else measured


def device_block_efficiency(
    config: Any, block_path: str, settings: RunSettings, hardware: Hardware, device: torch.device, seconds: float = 0.3
) -> float:
    """The fraction of ``hardware.flops`` one real block of ``config``'s model reaches on
    ``device`` at ``settings``' tokens: forward without grad (the streamed forward), then
    forward with grad and backward (the recompute and the backward), against their
    ``8 * P_b * T`` FLOPs (the CPU profile's ``block_efficiency``, measured on the GPU:
    planning/step_time.py, [Note: a step's phases]). Its MLP runs in the sequence tiles
    the engine would choose on this device (:func:`tile_like_the_engine`), so the tiled
    backward's extra MLP forward is in the time, as it is in the run's."""
    from megatrain_ds.runtime.device_runtime import DeviceRuntime

    runtime = DeviceRuntime.create(device)
    dtype = torch.bfloat16 if settings.bf16 else torch.float32
    block, model = _one_block_model(config, block_path, dtype)
    model.to(device)
    tile_like_the_engine(block, settings, device)
    ids = torch.randint(0, _PROFILE_VOCAB, (settings.micro_batch, settings.seq_len), device=device)

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids)
        runtime.synchronize()  # time the device's work, not the launches

    def forward_backward() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        runtime.synchronize()

    seconds_per_block = fastest_seconds(forward, seconds) + fastest_seconds(forward_backward, seconds)
    block_params = sum(p.numel() for p in block.parameters())
    return 8 * block_params * settings.tokens_per_pass / hardware.flops / seconds_per_block


def tile_like_the_engine(block: torch.nn.Module, settings: RunSettings, device: torch.device) -> int:
    """Run ``block``'s MLP in the sequence tiles the engine's ``"mlp_tile_tokens": "auto"``
    gives it on ``device`` (``engine_build.py``: from the FFN width and the memory free
    there; ``streaming/tiled_mlp.py``), so that a probe of the block does the run's work:
    a sequence longer than a tile costs one more MLP forward in backward (at ~3B, 8 x 2048
    tokens on an H200, 4096-token tiles). Returns the tile (0: whole, as without
    ``settings.tiled_mlp`` or an MLP)."""
    from megatrain_ds.planning.preflight import available_memory
    from megatrain_ds.streaming.tiled_mlp import tile_token_wise

    ffn = ffn_width(block)
    if not (settings.tiled_mlp and ffn):
        return 0
    available = available_memory(device)
    free = available.device if available.device is not None else available.host
    tokens = choose_mlp_tile_tokens(ffn, settings.weight_bytes, free)
    return tokens if tile_token_wise(block, tokens) else 0


def _measure_profile(config: Any, block_path: str, profiled: RunSettings, dtype: torch.dtype, seconds: float) -> dict:
    """The CPU profile's figures (:func:`cpu_profile`) at ``profiled``'s tokens."""
    seq_len, micro_batch, tokens = profiled.seq_len, profiled.micro_batch, profiled.tokens_per_pass
    block, model = _one_block_model(config, block_path, dtype)
    tile_like_the_engine(block, profiled, torch.device("cpu"))
    weight_shapes = [tuple(p.shape) for p in block.parameters() if p.dim() == 2]
    hidden = int(getattr(config, "hidden_size", None) or config.n_embd)
    vocab = int(config.vocab_size)
    head = (min(vocab, _HEAD_COLUMNS), hidden)

    def matmul_seconds(rows: int, cols: int) -> float:
        """Forward, input-gradient and weight-gradient matmuls of a [rows, cols] weight."""
        x, weight, dy = (
            torch.randn(tokens, cols, dtype=dtype),
            torch.randn(rows, cols, dtype=dtype),
            torch.randn(tokens, rows, dtype=dtype),
        )
        with torch.no_grad():
            return fastest_seconds(lambda: (x @ weight.t(), dy @ weight, dy.t() @ x), seconds / 4)

    distinct = {shape: weight_shapes.count(shape) for shape in weight_shapes}
    matmul_flops = sum(count * 6 * tokens * rows * cols for (rows, cols), count in distinct.items()) / sum(
        count * matmul_seconds(rows, cols) for (rows, cols), count in distinct.items()
    )
    head_flops = 6 * tokens * head[0] * head[1] / matmul_seconds(*head)
    block_params = sum(p.numel() for p in block.parameters())
    ids = torch.randint(0, _PROFILE_VOCAB, (micro_batch, seq_len))

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    def forward_backward() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    block_seconds = fastest_seconds(forward, seconds) + fastest_seconds(forward_backward, seconds)
    del block  # the model's memory goes with the closures when this function returns
    copy_rate = _copy_bytes_per_s(seconds)
    # The run's AdamW pass, one block's state per call ([Note: probing AdamW as the run runs it]).
    adam = probe_adam(adam_work(profiled, block_params), seconds).adam_bytes_per_s
    return {
        "flops": matmul_flops,
        "head_flops": head_flops,
        "block_efficiency": 8 * block_params * tokens / matmul_flops / block_seconds,
        "copy_bytes_per_s": copy_rate,
        "adam_bytes_per_s": adam,
        "block_seconds": block_seconds,
        "tokens": tokens,
        "load_average": os.getloadavg()[0],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _one_block_model(config: Any, block_path: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A real (random) one-block model of ``config``'s architecture with a tiny vocabulary,
    and its block: the head and embedding then cost next to nothing."""
    import copy

    import transformers

    small = copy.deepcopy(config)
    for attr in ("num_hidden_layers", "n_layer"):
        if hasattr(small, attr):
            setattr(small, attr, 1)
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:1]
    small.vocab_size = _PROFILE_VOCAB
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(small, attr, None), int) and getattr(small, attr) >= _PROFILE_VOCAB:
            setattr(small, attr, 0)
    model = transformers.AutoModelForCausalLM.from_config(small, dtype=dtype)
    return model.get_submodule(block_path)[0], model


def _format_bytes(value: float) -> str:
    return f"{value / GIB:,.2f} GiB"


def _print_fragments_and_disk(result, hardware: Hardware, settings: RunSettings) -> None:
    """``_print_plan``'s lines on fragmented weight streaming and the NVMe tier."""
    fragments = result.fragments
    chosen = int(fragments["chosen"]["fragment_bytes"])
    best = int(fragments["fragments"]["fragment_bytes"])
    print(
        f'fragmented weight streaming ("fragment_bytes": "auto" chooses '
        f"{f'{chosen:,} bytes' if chosen else 'whole blocks'}):"
    )
    print(
        f"  whole blocks      predicted step {fragments['whole']['predicted_step_seconds']:.4g} s"
        + (
            f"  (of which {result.weight_fill_seconds:.3g} s waiting for the weight pipeline's ends)"
            if not hardware.shares_host_memory
            else "  (nothing is copied: the device is the host)"
        )
    )
    print(
        f"  {f'{best:,} bytes' if best else 'fragments':17s} predicted step "
        f"{fragments['fragments']['predicted_step_seconds']:.4g} s"
        + ("" if best or hardware.shares_host_memory else "  (a block is too small to cut)")
    )
    if settings.nvme:
        weights = " (and the weights read in every forward and backward)" if settings.nvme_weights else ""
        print(
            f"NVMe tier: {_format_bytes(result.disk_bytes)} of swap files, read and written once per optimizer "
            f"step{weights}; disk {hardware.disk_read_bytes_per_s / 1e9:.2f} GB/s read, "
            f"{hardware.disk_write_bytes_per_s / 1e9:.2f} GB/s write"
        )
        if result.recommended.get("bottleneck") == "disk":
            print(
                f"the disk is the bottleneck: {result.recommended['gradient_accumulation_steps']} micro-batches "
                "per optimizer step would spread its traffic enough to hide it"
            )


def _print_plan(
    result,
    hardware: Hardware,
    settings: RunSettings,
    position_limit: int | None = None,
    sources: dict[str, str] | None = None,
) -> None:
    """The plan as a table (``megatrain plan`` without ``--json``); ``position_limit``: the
    model's ``max_position_embeddings``, named beside a memory limit above it; ``sources``:
    where each figure came from (``hardware_figures.figure_sources``)."""
    print(
        f"parameters: {result.params / 1e9:.3f} B   device: {hardware.name}   "
        f"tokens per weight pass: {settings.tokens_per_pass}"
    )
    print("host memory:")
    for kind, value in result.host_bytes.items():
        print(f"  {kind:18s} {_format_bytes(value)}")
    print(f"  {'total':18s} {_format_bytes(result.host_bytes_total)}")
    print("GPU memory:" if not hardware.shares_host_memory else "compute-side memory (host):")
    for kind, value in result.gpu_bytes.items():
        print(f"  {kind:18s} {_format_bytes(value)}")
    print(f"  {'total':18s} {_format_bytes(result.gpu_bytes_total)}")
    if settings.device_state_share:
        print(f"GPU tier (device_state): {settings.device_state_share:.1%} of the trained parameters' state on the GPU")
    if hardware.shares_host_memory:
        print(
            f"peak host memory: {_format_bytes(result.predicted_peak_host_bytes)} "
            f"({result.predicted_peak_host_bytes / result.params:.2f} bytes/param)"
        )
        print(
            f"measured: matmul {hardware.flops / 1e9:.0f} GFLOP/s at the blocks' shapes "
            f"({hardware.head_flops / 1e9:.0f} at the head's), a block at "
            f"{hardware.block_efficiency:.0%} of it, memory copy {hardware.host_memory_bytes_per_s / 2e9:.1f} GB/s, "
            f"AdamW {hardware.adam_bytes_per_s / 1e9:.1f} GB/s"
        )
        print("step (one set of cores does each part in turn):")
    else:
        print(f"tokens per weight pass to hide transfers: {result.min_tokens_to_hide_transfer}")
        print("each resource alone (the largest is the floor):")
    for bound, seconds in result.step_seconds_by_bound.items():
        print(f"  {bound:18s} {seconds:8.3f} s/step")
    if not hardware.shares_host_memory:
        print("the step's phases, one after another (the optimizer's behind backward without held gradients):")
        for phase, seconds in result.step_seconds_by_phase.items():
            print(f"  {phase:20s} {seconds:8.3f} s/step")
    print(f"predicted step: {result.predicted_step_seconds:.3f} s, {result.predicted_tokens_per_second:,.0f} tokens/s")
    print("recompute (host memory for stashed activations vs. recomputing blocks in backward):")
    for name, policy in result.recompute.items():
        print(
            f"  {name:5s} {policy['stashed_blocks']:4.0f} blocks stashed  {_format_bytes(policy['stash_bytes'])} "
            f"stash  predicted step {policy['predicted_step_seconds']:.4g} s"
        )
    _print_fragments_and_disk(result, hardware, settings)
    print(f"largest micro-batch that fits: {result.max_micro_batch}")
    print(f"memory per token of sequence: {result.bytes_per_token / 1024:,.1f} KiB")
    beyond_model = f"; the model's max_position_embeddings is {position_limit:,}"
    model_note = beyond_model if position_limit is not None and position_limit < result.max_seq_len else ""
    batch = f"(micro-batch {settings.micro_batch})"
    print(f"max sequence length: {result.max_seq_len:,} tokens {batch}, by memory{model_note}")
    for name, source in (sources or {}).items():  # before the last line, which scripts parse
        print(f"figure {name}: {source}")
    if settings.device_state_share >= 1.0:  # before the last line, which scripts parse
        print("(optimizer_device, below: where the states left in host memory would be updated; none are here)")
    print("recommended: " + json.dumps(result.recommended))


def _device_state_argument(value: str) -> str | float:
    """``--device-state``: "auto", "none" (a share of 0), or a share between 0 and 1."""
    if value == "auto":
        return value
    if value == "none":
        return 0.0
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f'"auto", "none" or a share between 0 and 1, not {value!r}')
    return share


def _parser() -> argparse.ArgumentParser:
    """``megatrain``'s arguments: the ``plan`` command and its run settings."""
    parser = argparse.ArgumentParser(prog="megatrain", description="megatrain_ds tools")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="memory and speed of a run, before running it")
    p.add_argument("--model", required=True, help="Hugging Face model directory or config JSON")
    p.add_argument("--gpu", required=True, choices=[*GPU_HARDWARE, "cpu"])
    p.add_argument(
        "--host-memory", type=parse_size, default=None, help="host memory, e.g. 1536GB (default: this machine's)"
    )
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--fp32", action="store_true", help="fp32 compute (default bf16; cpu implies fp32)")
    p.add_argument("--no-clipping", action="store_true")
    p.add_argument("--checkpoint-interval", type=int, default=1)
    p.add_argument(
        "--stashed-blocks",
        type=int,
        default=0,
        help='blocks that stash their activations instead of recomputing ("recompute": "none" stashes all; '
        "bench/compare.py passes the number its round stashed); default 0, every block recomputed",
    )
    p.add_argument("--keep-checkpoints-on-device", action="store_true")
    p.add_argument("--block-path", default=None)
    p.add_argument(
        "--nvme",
        metavar="PATH",
        default=None,
        help="the blocks' Adam m and v (and fp32 masters with bf16) on the NVMe tier, swap files "
        "under PATH (its disk is measured)",
    )
    p.add_argument("--nvme-window-blocks", type=int, default=4)
    p.add_argument(
        "--nvme-weights",
        action="store_true",
        help='with --nvme: the blocks\' weights on the tier too ("nvme_offload": "all")',
    )
    p.add_argument(
        "--optimizer-device-share",
        type=float,
        default=0.0,
        help='share of the optimizer state stepped on the device ("optimizer_device": "gpu": 1; "auto": the '
        "share its logged split puts there); default 0, all on the host's CPU kernel",
    )
    p.add_argument(
        "--device-state",
        type=_device_state_argument,
        default="auto",
        help='the GPU tier ("device_state"): "auto" (the engine\'s default: as many states as fit in the GPU\'s '
        'memory left by the run; none with --nvme or --gpu cpu), "none", or the share of the trained parameters '
        "kept whole on the device",
    )
    _add_figure_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _add_figure_arguments(p: argparse.ArgumentParser) -> None:
    """``plan``'s arguments on where its figures come from (``planning/hardware_figures.py``)."""
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="with --gpu cpu: measure this machine again instead of using the cached profile",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="with a GPU target: measure this machine (the run's CPU AdamW pass past the caches, memory copies; "
        "with a CUDA device that pass beside pinned copies, the copies and a real block of the model) instead of "
        "the table's typical one",
    )
    p.add_argument(
        "--hardware",
        metavar="JSON",
        default=None,
        help='the figures of an earlier plan\'s --json output (its "hardware", e.g. what --probe measured there) '
        "instead of the table's or measuring them again",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    host_memory = args.host_memory or physical_memory()
    settings = RunSettings(
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        accumulation=args.gradient_accumulation_steps,
        bf16=not (args.fp32 or args.gpu == "cpu"),
        clipping=not args.no_clipping,
        checkpoint_interval=args.checkpoint_interval,
        stashed_blocks=args.stashed_blocks,
        offload_checkpoints=not args.keep_checkpoints_on_device,
        nvme=args.nvme is not None,
        nvme_window_blocks=args.nvme_window_blocks,
        nvme_weights=args.nvme_weights,
        device_optimizer_share=args.optimizer_device_share,
        device_state_share=args.device_state if isinstance(args.device_state, float) else 0.0,
    )
    if not 0 <= args.optimizer_device_share <= 1:
        parser.error("--optimizer-device-share is a fraction of the optimizer state: between 0 and 1")
    if settings.device_state_share and args.nvme is not None:
        parser.error('--device-state takes no share of the trained parameters with --nvme: "auto" or "none"')
    if args.nvme_weights and args.nvme is None:
        parser.error("--nvme-weights needs --nvme PATH (the disk the weights are read from)")
    if problem := hardware_figures.figure_argument_problem(args.gpu, args.probe, args.recalibrate, args.hardware):
        parser.error(problem)
    model = load_meta_model(args.model)
    shape = shape_of(model, args.block_path)
    if not 0 <= args.stashed_blocks <= shape.num_blocks:
        parser.error(f"--stashed-blocks: from 0 to the model's {shape.num_blocks} blocks, not {args.stashed_blocks}")
    try:
        hardware, sources = _hardware_for(args, model, shape, settings)
    except ValueError as error:  # a --hardware file that does not hold this plan's figures
        parser.error(str(error))
    if args.device_state == "auto":  # the engine's default, resolved as the engine does
        settings = dataclasses.replace(settings, device_state_share=auto_device_state_share(shape, settings, hardware))
    result = plan(shape, settings, hardware, host_memory)
    if args.json:
        data = result.to_json()
        data["hardware"] = asdict(hardware)
        data["hardware_sources"] = sources
        data["settings"] = asdict(settings)
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        shown = sources if args.gpu != "cpu" or args.hardware else {}  # the CPU's are printed as measured
        _print_plan(result, hardware, settings, getattr(model.config, "max_position_embeddings", None), shown)
    return 0


def _cuda_here() -> bool:
    from megatrain_ds.runtime.device_runtime import cuda_available

    return cuda_available()


def _hardware_for(
    args: argparse.Namespace, model: torch.nn.Module, shape: ModelShape, settings: RunSettings
) -> tuple[Hardware, dict[str, str]]:
    """The figures ``megatrain plan`` plans with, and where each came from: a file's
    (``--hardware``), the CPU profile, the GPU table's, or the table's with this machine
    measured by ``--probe``; and the NVMe tier's disk."""
    sources = hardware_figures.figure_sources(args.gpu, args.probe, _cuda_here())
    if args.hardware is not None:
        hardware, sources = hardware_figures.hardware_from_file(args.hardware, args.gpu)
    elif args.gpu == "cpu":
        block_path, _ = find_blocks(model, args.block_path)
        hardware = cpu_profile(model.config, block_path, settings, recalibrate=args.recalibrate)
    else:
        hardware = GPU_HARDWARE[args.gpu]
        if args.probe:
            block_path, _ = find_blocks(model, args.block_path)
            hardware = probe_host(
                hardware,
                # The run's AdamW pass: its settings, one block's trained state per call.
                adam_work(settings, stepped_block_params(shape)[0]),
                lambda measured: device_block_efficiency(
                    model.config, block_path, settings, measured, torch.device("cuda")
                ),
            )
    if args.nvme is not None:
        from megatrain_ds.optimizer.placement import cache_path

        disk = cached_disk_bandwidth(args.nvme, cache_path().with_name("disk_bandwidth.json"), args.recalibrate)
        hardware = dataclasses.replace(hardware, disk_read_bytes_per_s=disk.read, disk_write_bytes_per_s=disk.write)
    return hardware, hardware_figures.name_stand_ins(hardware, sources)


if __name__ == "__main__":
    sys.exit(main())
