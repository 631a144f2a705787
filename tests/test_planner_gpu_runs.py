"""The planner against the GPU runs committed under ``bench/results/gpu_H200/2026-11-27`` (the
second run), ``2026-11-27-third`` (the third, the first with the pipelined finish) and
``2026-11-27-fourth`` (the fourth, the first with the GPU tier, ``device_state``).

Each recorded engine step (one H200, 16 host cores, bf16, clipping 1.0) is predicted from
the run's model, batch and placement and from hardware figures measured on that machine,
and must come within :data:`TOLERANCE` of the measured median step (issue 42, item 5). The
steps are the third and fourth runs': the second run's ran code since changed in the phases the
model times (a synchronous finish, and a wait for a checkpoint before each block's
recompute, 34 ms of its backward at 940M). The figures and where each comes from (the
second run's host measurements: the same kind of machine, and the third run did not repeat
them):

- ``flops``, device memory: the ``planner_hardware`` ``bench/compare.py`` recorded (the
  h200 table's 790 TFLOP/s);
- the link, each way: ``host_contention.json``'s pinned copies running both ways at once
  (47 GB/s; the recorded 50 GB/s was the table's, not measured);
- the CPU AdamW kernel: ``host_contention.json``'s rate alone at 16 threads on 100M
  elements (117 GB/s at 28 B/element). The recorded probe figure (391 GB/s) timed 16M
  elements that sat in that host's last-level cache; the probe now sizes its states from
  the cache, and makes the run's pass (``tests/test_host_probe.py``);
- ``block_efficiency``, what ``--probe`` now measures on the device (a real block forward,
  then forward and backward): for the 940M from ``timeline.json``, a separate traced run of
  the same model and batch (its forward, recompute and backward spans of step 2); for the
  3B, which has no timeline, from its own run's trace (``trace_split.compute``, the same
  spans summed), so there the compute phase is calibrated on the run it predicts and the
  check is of the rest: the link, the waits, the optimizer and how the phases compose (the
  fourth run has no timeline: all its steps take their compute from their own trace);
- the device's share of the optimizer state: the run's recorded placement
  (``optimizer_placement``: so many of the 17 or 29 states on ``DeviceAdamW``), taken as
  block states (the trace shows block-sized device states; the 17th/29th is the resident
  one); and the GPU tier's share, the elements its recorded ``device_state`` placement held.

With the same figures the model before this change (the longest of the overlapped bounds
plus the optimizer pass) predicted 0.300 s for the 940M's 0.447 s (auto placement) and
0.473 s (CPU placement), and 1.347 s for the 3B's 2.247 s: 33%, 37% and 40% short. With the
figures it was given in the run (the in-cache Adam rate, the table's link) it predicted
0.138 s and 0.137 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models
import torch

from megatrain_ds import cli
from megatrain_ds.planning import step_time
from megatrain_ds.planning.planner import Hardware, ModelShape, RunSettings, plan

SECOND = Path(__file__).resolve().parent.parent / "bench/results/gpu_H200/2026-11-27"
THIRD = SECOND.with_name("2026-11-27-third")
FOURTH = SECOND.with_name("2026-11-27-fourth")

TOLERANCE = 0.25
"""Issue 42's bar for the predicted step against the measured one."""

BYTES_PER_ADAM_ELEMENT = 28
"""``host_contention.json``'s ``adam_gb_per_s`` counts 28 bytes per element (fp32 p, m, v
read and written, g read), as the planner's ``adam_bytes_per_s`` does."""


def _load(name: str, results: Path = SECOND) -> dict:
    return json.loads((results / name).read_text())


def _shape(model: dict) -> ModelShape:
    """The recorded model as ``bench/compare.py`` builds it: a Llama whose blocks hold q, k,
    v, o (``4 h^2``; as many key/value heads as heads), gate, up and down (``3 h i``) and two
    norms (``2 h``), with an untied embedding and lm_head (``2 V h``) and the final norm
    (``h``). The count must match the run's recorded parameters exactly."""
    hidden, intermediate, vocab = model["hidden"], model["intermediate"], model["vocab"]
    block = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    shape = ModelShape(
        num_blocks=model["layers"],
        block_params=block,
        total_block_params=model["layers"] * block,
        resident_params=2 * vocab * hidden + hidden,
        hidden=hidden,
        vocab=vocab,
        intermediate=intermediate,
        kv_hidden=hidden,
    )
    assert shape.params == model["params"]  # the same model as the run's
    return shape


def _timeline_block_seconds(results: Path) -> float:
    """Seconds the 940M's blocks computed in the traced run's second step: forward,
    recompute and backward spans of every block (the first step warms up)."""
    events = _load("timeline.json", results)["traceEvents"]
    spans = [
        event["dur"]
        for event in events
        if event.get("ph") == "X"
        and event.get("args", {}).get("step") == 2
        and event.get("args", {}).get("phase") in ("forward", "recompute", "backward")
    ]
    assert len(spans) == 3 * 16
    return sum(spans) / 1e6  # the trace's microseconds


def _hardware(run: dict, shape: ModelShape, tokens: int, block_seconds: float | None, results: Path) -> Hardware:
    """The figures listed in the module's docstring; ``block_seconds`` ``None``: the block
    efficiency the run's ``--probe`` measured on the device (runs from now on record it)."""
    contention = _load("host_contention.json")
    alone = next(entry for entry in contention["threads"] if entry["threads"] == contention["cores"])
    link = contention["copies_gb_per_s_each_way_alone"] * 1e9
    recorded = run.get("planner_hardware") or _load("compare.json", results)["results"]["megatrain"]["planner_hardware"]
    flops = recorded["flops"]
    return Hardware(
        "h200",
        flops,
        link,
        link,
        recorded["host_memory_bytes_per_s"],
        recorded["device_memory_bytes"],
        # The cli's profile definition: 8 P_b T FLOPs over the blocks' compute time.
        block_efficiency=8 * shape.total_block_params * tokens / flops / block_seconds
        if block_seconds is not None
        else recorded["block_efficiency"],
        adam_bytes_per_s=alone["adam_gb_per_s"] * 1e9,
        adam_beside_copies_bytes_per_s=alone["adam_g_elements_per_s_beside_copies"] * 1e9 * BYTES_PER_ADAM_ELEMENT,
    )


def _device_share(placement: dict, shape: ModelShape) -> float:
    """The parameters' share whose state the run stepped on the device: its elements per
    kernel where recorded (``bench/compare.py`` records them from now on), else its
    ``DeviceAdamW`` states counted as block states."""
    elements = placement.get("elements_by_kernel")
    if elements:
        return elements.get("DeviceAdamW", 0) / sum(elements.values())
    return placement.get("by_kernel", {}).get("DeviceAdamW", 0) * shape.block_params / shape.params


RUNS = {  # name: (run, file, system, where the block rate comes from)
    "940m_pipelined": (THIRD, "compare.json", "megatrain", "timeline"),
    "3b_pipelined": (THIRD, "compare_3b.json", "megatrain", "own trace"),
    "940m_pipelined_fourth": (FOURTH, "compare.json", "megatrain", "own trace"),
    "940m_device_state": (FOURTH, "compare.json", "megatrain_device_state_auto", "own trace"),
    "3b_device_state": (FOURTH, "compare_3b.json", "megatrain_device_state_auto", "own trace"),
}


def _device_state_share(placement: dict, shape: ModelShape) -> float:
    """The parameters' share the GPU tier held (runs before it record none)."""
    return placement.get("device_state", {}).get("elements", 0) / shape.params


@pytest.mark.parametrize("run_name", list(RUNS))
def test_the_predicted_step_is_within_a_quarter_of_the_measured_gpu_step(run_name):
    results, file, system, compute_from = RUNS[run_name]
    record = _load(file, results)
    run = record["results"][system]
    shape = _shape(record["model"])
    batch = record["batch"]
    tokens = batch["micro_batch"] * batch["seq_len"]
    block_seconds = {
        "timeline": lambda: _timeline_block_seconds(results),
        "own trace": lambda: run["trace_split"]["compute"],
    }[compute_from]()
    hardware = _hardware(run, shape, tokens, block_seconds, results)
    settings = RunSettings(
        seq_len=batch["seq_len"],
        micro_batch=batch["micro_batch"],
        clipping=bool(batch["gradient_clipping"]),
        device_optimizer_share=_device_share(run["optimizer_placement"], shape),
        device_state_share=_device_state_share(run["optimizer_placement"], shape),
    )
    result = plan(shape, settings, hardware, host_memory_bytes=128 << 30)
    ratio = result.predicted_step_seconds / run["step_seconds"]
    assert abs(ratio - 1) <= TOLERANCE, (
        run_name,
        result.predicted_step_seconds,
        run["step_seconds"],
        result.step_seconds_by_phase,
    )
    # The finish as the run measured it too, within the same bar: the step's largest part at
    # both sizes without the GPU tier. It runs behind the next forward, so it is timed by its
    # own spans on the finish worker (the trace's "optimizer"; step() itself takes a
    # millisecond). With every state on the GPU there is no host pass: both are zero.
    assert step_time.finish_pipelines(settings)
    phases = result.step_seconds_by_phase
    assert phases["optimizer"] == pytest.approx(run["trace_split"]["optimizer"], rel=TOLERANCE)


def test_the_device_block_probe_times_a_real_block_forward_then_forward_and_backward(monkeypatch):
    """``device_block_efficiency`` (run here on the CPU: the code a CUDA device runs, but
    for the device) times two pieces of work, a forward without grad and then a forward
    and backward of one real block, and divides ``8 P_b T`` by the flops figure and their
    sum. The timings are replaced by fixed ones (a 2-core CI machine times millisecond
    work with several-fold noise); the work still runs, and whether it ran a backward is
    seen by the block's gradient hooks."""
    model = tiny_models.llama(2)  # the suite's tiny Llama: its classes are imported already
    block_path, _ = cli.find_blocks(model, None)
    backward_passes, block_params, ran_backward = [], [], []
    real = cli._one_block_model

    def spied(config, path, dtype):
        block, one_block = real(config, path, dtype)
        block_params.append(sum(p.numel() for p in block.parameters()))
        for parameter in one_block.parameters():
            parameter.register_post_accumulate_grad_hook(lambda _: backward_passes.append(1))
        return block, one_block

    timings = iter([0.002, 0.006])

    def fixed_best_seconds(work, budget, min_runs=3):
        before = len(backward_passes)
        work()
        ran_backward.append(len(backward_passes) > before)
        return next(timings)

    monkeypatch.setattr(cli, "_one_block_model", spied)
    monkeypatch.setattr(cli, "fastest_seconds", fixed_best_seconds)
    hardware = Hardware("any", 1e12, 1e9, 1e9, 1e9, 1 << 30)
    settings = RunSettings(seq_len=64, micro_batch=2, bf16=False)
    efficiency = cli.device_block_efficiency(model.config, block_path, settings, hardware, torch.device("cpu"))
    assert ran_backward == [False, True]
    assert efficiency == pytest.approx(8 * block_params[0] * 128 / 1e12 / (0.002 + 0.006))


def test_the_block_probe_runs_the_mlp_in_the_tiles_the_engine_would(monkeypatch):
    """Where the engine would tile a block's MLP (``"mlp_tile_tokens": "auto"``: the tile
    ``choose_mlp_tile_tokens`` gives for the memory free), the probe's block does too, so
    its time holds the tiled backward's extra MLP forward: the MLP's own forward runs once
    per tile in the forward, and once more per tile in backward. The free memory is fixed
    small here so that 2 x 512 tokens make several tiles."""
    from megatrain_ds.planning import preflight
    from megatrain_ds.planning.long_context import choose_mlp_tile_tokens, ffn_width
    from megatrain_ds.streaming.tiled_mlp import TiledTokenWise

    free = 4 << 20
    monkeypatch.setattr(
        preflight, "available_memory", lambda device: preflight.AvailableMemory(free, "test", None, None)
    )
    model = tiny_models.llama(2)
    block_path, _ = cli.find_blocks(model, None)
    settings = RunSettings(seq_len=512, micro_batch=2, bf16=False)
    block, one_block = cli._one_block_model(model.config, block_path, torch.float32)
    tile = cli.tile_like_the_engine(block, settings, torch.device("cpu"))
    assert tile == choose_mlp_tile_tokens(ffn_width(block), 4, free) and 0 < tile < settings.tokens_per_pass
    tiles = -(-settings.tokens_per_pass // tile)
    calls = []
    tiled = block.get_submodule("mlp").forward
    assert isinstance(tiled, TiledTokenWise)
    whole = tiled.whole
    tiled.whole = lambda *args, **kwargs: calls.append(1) or whole(*args, **kwargs)
    ids = torch.randint(0, 256, (settings.micro_batch, settings.seq_len))
    with torch.no_grad():
        one_block(input_ids=ids)
    assert len(calls) == tiles
    calls.clear()
    one_block(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 2 * tiles
    assert cli.tile_like_the_engine(block, RunSettings(seq_len=512, tiled_mlp=False), torch.device("cpu")) == 0
