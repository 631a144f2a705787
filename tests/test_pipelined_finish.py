"""The optimizer update pipelined into the next forward (``megatrain_ds/optimizer/pipelined_finish.py``).

Checked against independent facts: plain PyTorch (AdamW, ``clip_grad_norm_`` and a
``LambdaLR`` stepped after every optimizer step) for the values, the same engine with its
update run synchronously inside ``step()`` for checkpoints (the same ops on the same values:
bit for bit), and the trace's clocks for the overlap. Tolerances where PyTorch is the
reference are test_parity.py's (fp32 on the CPU: the engine's norm is summed per block, its
block gradients come out of a recompute): 1e-5 relative per loss, 2e-6 relative weight error.

A slowed finish worker (a sleep before each state's update, which releases the GIL) makes
the interleavings that matter certain rather than likely: the update is still running when
``step()`` returns, when the scheduler steps and when the checkpoint is taken.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import tiny_models
import torch
from safetensors.torch import load_file
from side_by_side import LR, WEIGHT_DECAY, ds_config, relative_weight_error
from test_parity import LOSS_RTOL, WEIGHT_RTOL

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.optimizer.pipelined_finish import refusal

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

WORKER = "megatrain finish worker"


def slow_finish_worker(engine: MegatrainEngine, seconds: float) -> None:
    """Each update the finish worker runs starts ``seconds`` late (updates on other threads do not)."""
    update_range = engine.adamw.update_range

    def slowed(*args, **kwargs):
        if threading.current_thread().name == WORKER:
            time.sleep(seconds)
        return update_range(*args, **kwargs)

    engine.adamw.update_range = slowed


def synchronous(engine: MegatrainEngine) -> MegatrainEngine:
    """The same engine with today's synchronous finish (the update inside ``step()``)."""
    engine.pipelined_finish = None
    engine.streamer.pending_updates = None
    return engine


def _engine(config: dict, num_layers: int = 3, **kwargs) -> MegatrainEngine:
    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=num_layers)
    return MegatrainEngine(model, parse_engine_config(config), device=torch.device("cpu"), **kwargs)


def test_the_update_overlaps_the_next_forward_in_block_order(tmp_path):
    """Step 1's update (traced) runs behind ``step()``: its last block lands after step 2's
    forward of block 0 began, and each block's forward begins only after its own update."""
    path = tmp_path / "trace.json"
    engine = _engine(ds_config(clipping=1.0, megatrain={"trace": str(path), "trace_steps": 2}), num_layers=4)
    slow_finish_worker(engine, 0.1)
    try:
        assert engine.pipelined_finish is not None
        for step in range(3):
            engine.backward(engine(**tiny_models.make_batch(step)).loss)
            engine.step()
            assert engine.last_step_report is not None and engine.last_step_report.outcome.value == "clipped"
    finally:
        engine.destroy()
    document = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in document["traceEvents"] if e.get("name") == "thread_name"}
    spans = defaultdict(list)
    for event in document["traceEvents"]:
        if event["ph"] == "X":
            spans[names[event["tid"]]].append(event)
    updates = {
        e["args"]["state"]: e
        for e in spans["optimizer worker"]
        if e["name"].startswith("adamw") and e["args"]["step"] == 1
    }
    forwards = {
        e["args"]["block"]: e for e in spans["compute"] if e["args"]["phase"] == "forward" and e["args"]["step"] == 2
    }
    step_1 = next(e for e in spans["step"] if e["args"]["step"] == 1)
    end = {state: e["ts"] + e["dur"] for state, e in updates.items()}
    resident = engine._resident_index
    assert set(updates) == set(range(resident + 1))  # every state, blocks and resident
    assert end[resident] <= min(e["ts"] for e in updates.values() if e["args"]["state"] != resident)  # first
    assert step_1["ts"] + step_1["dur"] < end[resident]  # step() returned with the update in flight
    assert end[3] > forwards[0]["ts"]  # block 3 was updated while block 0 computed
    for block, forward in forwards.items():
        assert forward["ts"] >= end[block] and forward["ts"] >= end[resident]


def test_a_scheduler_stepped_after_step_changes_only_the_next_update():
    """The engine steps its ``LambdaLR`` right after ``step()`` started the update; the
    update must use the learning rate of the step it belongs to, as PyTorch's does."""
    config = ds_config(clipping=1.0)
    del config["optimizer"]
    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=3)
    reference = copy.deepcopy(model)

    def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)

    client = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    engine = MegatrainEngine(
        model, parse_engine_config(config), optimizer=client, lr_scheduler=halving(client), device=torch.device("cpu")
    )
    slow_finish_worker(engine, 0.02)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = halving(optimizer)
    try:
        assert engine.pipelined_finish is not None
        for step in range(4):
            batch = tiny_models.make_batch(step)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            reference_loss = reference(**batch).loss
            reference_loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            assert norm > 1.0  # clipping fired: the pipelined path
            assert math.isclose(loss.item(), reference_loss.item(), rel_tol=LOSS_RTOL)
        assert engine.get_lr() == scheduler.get_last_lr()
        assert relative_weight_error(engine, reference) < WEIGHT_RTOL
    finally:
        engine.destroy()


def _checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.rglob("*.safetensors"))
    assert files, f"no tensors saved under {directory}"
    return {f"{file.relative_to(directory)}:{key}": value for file in files for key, value in load_file(file).items()}


def test_a_checkpoint_taken_right_after_step_equals_the_synchronous_one(tmp_path):
    """``save_checkpoint`` while the update is in flight settles it first: every tensor
    saved (masters, moments, weights) is bit for bit what the synchronous finish saves."""
    saved = {}
    for name, make in (("pipelined", lambda e: e), ("synchronous", synchronous)):
        engine = make(_engine(ds_config(clipping=1.0, accumulation=2)))
        slow_finish_worker(engine, 0.02)
        try:
            for micro in range(4):
                engine.backward(engine(**tiny_models.make_batch(micro)).loss)
                engine.step()
            pipelined = engine.pipelined_finish
            assert (pipelined is not None and pipelined.in_flight) == (name == "pipelined")
            engine.save_checkpoint(str(tmp_path / name), tag="step2")
            saved[name] = _checkpoint_tensors(tmp_path / name / "step2")
        finally:
            engine.destroy()
    assert saved["pipelined"].keys() == saved["synchronous"].keys()
    for key, value in saved["synchronous"].items():
        assert torch.equal(saved["pipelined"][key], value), key


def _read_right_after_step(read):
    """``read(engine)`` right after a clipped ``step()``, on the pipelined engine (its update
    still in flight, slowed) and on the synchronous one: ``{"pipelined": ..., "synchronous": ...}``."""
    results = {}
    for name, make in (("pipelined", lambda e: e), ("synchronous", synchronous)):
        engine = make(_engine(ds_config(clipping=1.0)))
        slow_finish_worker(engine, 0.02)
        try:
            engine.backward(engine(**tiny_models.make_batch(0)).loss)
            engine.step()
            pipelined = engine.pipelined_finish
            assert (pipelined is not None and pipelined.in_flight) == (name == "pipelined")
            results[name] = read(engine)
        finally:
            engine.destroy()
    return results


def test_gathered_parameters_reads_the_updated_weights():
    """``deepspeed.zero.GatheredParameters``, which TRL and transformers enter to read a
    ZeRO-3 model's weights between steps, waits for the update in flight (compat.py's patch
    5): inside it the parameters are bit for bit the synchronous finish's."""
    import deepspeed

    def gathered(engine):
        parameters = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(parameters):
            return [p.detach().clone() for p in parameters]

    weights = _read_right_after_step(gathered)
    assert all(torch.equal(a, b) for a, b in zip(weights["pipelined"], weights["synchronous"]))


def test_a_state_dict_taken_right_after_step_equals_the_synchronous_one():
    """``state_dict()`` right after ``step()`` (``save_pretrained``, Accelerate's
    ``get_state_dict``) waits for the update in flight: every tensor, copied as soon as it
    returns, is bit for bit the synchronous finish's. The race checker cannot see this wait
    missing (the reads are the caller's, after state_dict returns: tests/test_stream_ordering.py)."""
    saved = _read_right_after_step(lambda engine: {key: value.clone() for key, value in engine.state_dict().items()})
    assert saved["pipelined"].keys() == saved["synchronous"].keys()
    for key, value in saved["synchronous"].items():
        assert torch.equal(saved["pipelined"][key], value), key


def test_a_direct_call_of_the_model_waits_for_the_resident_update(stream_check):
    """``engine.module(...)`` (no ``engine(...)``: nothing plans the blocks before the
    embedding computes) still trains as PyTorch does: the model's forward hook waits for
    the resident parameters' update and refreshes their device copy. Under the race checker
    the device copy is apart from the host master, so a missing wait reads the old one."""
    engine = _engine(ds_config(clipping=1.0))
    torch.manual_seed(0)  # _engine's seed: the same initial weights
    reference = tiny_models.llama(num_layers=3)
    slow_finish_worker(engine, 0.01)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    try:
        for step in range(3):
            batch = tiny_models.make_batch(step)
            loss = engine.module(**batch).loss
            engine.backward(loss)
            engine.step()
            reference_loss = reference(**batch).loss
            reference_loss.backward()
            assert float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)) > 1.0
            optimizer.step()
            optimizer.zero_grad()
            assert math.isclose(loss.item(), reference_loss.item(), rel_tol=LOSS_RTOL), step
        assert relative_weight_error(engine, reference) < WEIGHT_RTOL
    finally:
        engine.destroy()


def test_an_update_that_fails_on_the_worker_fails_the_next_forward():
    engine = _engine(ds_config(clipping=1.0))
    update_range = engine.adamw.update_range

    def failing(*args, **kwargs):
        if threading.current_thread().name == WORKER:
            raise MemoryError("the finish worker ran out of memory")
        return update_range(*args, **kwargs)

    engine.adamw.update_range = failing
    try:
        engine.backward(engine(**tiny_models.make_batch(0)).loss)
        engine.step()  # returns: the update runs behind it
        with pytest.raises(MemoryError, match="finish worker"):
            engine(**tiny_models.make_batch(1))
    finally:
        engine.destroy()


def test_which_configurations_pipeline_the_finish():
    held = dict(holds_gradients=True, data_parallel=False, nvme_tier=False, on_host_only=True)
    assert refusal(**held) is None
    assert "backward" in (refusal(**{**held, "holds_gradients": False}) or "")
    assert "gather" in (refusal(**{**held, "data_parallel": True}) or "")
    assert "NVMe" in (refusal(**{**held, "nvme_tier": True}) or "")
    assert "DeviceAdamW" in (refusal(**{**held, "on_host_only": False}) or "")
    for clipping, accumulation, pipelined in ((1.0, 1, True), (0.0, 2, True), (0.0, 1, False)):
        engine = _engine(ds_config(clipping=clipping, accumulation=accumulation), num_layers=2)
        try:
            assert (engine.pipelined_finish is not None) == pipelined
        finally:
            engine.destroy()
