"""Call orders that had run only on the CPU, on a real CUDA device (issue 42, "When a GPU was lent").

Skipped without CUDA (CI has none); ``scripts/gpu_validate.sh`` runs this file in its
``gpu-tests`` step and again under PyTorch's CUDA sanitizer (its ``sanitizer`` step), which
fails a test whose device work misses a stream synchronisation. Each body takes the device
as an argument: the same bodies ran on the CPU when they were written (``torch.device("cpu")``,
no CUDA there), and their CPU counterparts are in the suite already:

- ``step()`` twice with no backward between (engine.py ``_before_update``: the host
  waits for the device, whose refresh of the resident copy reads the host weights
  the next update writes; on the CPU only ``tests/stream_race_scenario.py``'s
  ``forward-ahead`` runs it);
- the evaluation-only engine (optimizer/facade.py: [Note: evaluation-only engines];
  ``tests/test_evaluation_only.py``) in fp32 and bf16, ``"device_state"`` "auto" and "none";
- a forward between a step's last backward and ``step()`` (the warning where the worker
  updates during backward, the forward ordered against the update, its copies ahead dropped:
  ``tests/test_speculative_step.py`` runs the same flow under the CPU race checker), and the
  training around it;
- ``state_dict()`` right after a pipelined ``step()`` with every state on the host
  (optimizer/pipelined_finish.py; ``tests/test_pipelined_finish.py``).

References: plain PyTorch on the same device (``torch.optim.AdamW``, ``clip_grad_norm_``).
Tolerances, fp32: the parity suite's (``test_parity.py``: 1e-5 relative per loss, 2e-6
relative weight error; TF32 is off by default, so the engine's and PyTorch's matmuls differ
only in the order their kernels sum, ~1e-7 relative per product, the engine's norm summed per
block). A tiny Llama (2 or 3 blocks, 2 x 12 tokens): every test about a second on a GPU.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import cast

import pytest
import tiny_models
import torch
from side_by_side import LR, WEIGHT_DECAY, ds_config, relative_error, relative_weight_error
from test_parity import LOSS_RTOL, WEIGHT_RTOL
from test_pipelined_finish import slow_finish_worker

from megatrain_ds import MegatrainEngine, parse_engine_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HOST_STATE = {"device_state": "none"}
"""Every optimizer state on the host: the default ("auto") keeps a tiny model's states whole
on the GPU, where there is no update behind ``step()`` and no worker updating during backward."""

CUDA = torch.device("cuda")


def _batch(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in tiny_models.make_batch(seed).items()}


def _side_by_side(config: dict, device: torch.device, num_layers: int = 3):
    """The engine on ``device`` and a deep copy of its model there with ``torch.optim.AdamW``."""
    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=num_layers)
    reference = cast(torch.nn.Module, copy.deepcopy(model)).to(device)  # transformers types .to oddly
    engine = MegatrainEngine(model, parse_engine_config(config), device=device)
    return engine, reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def _delay_stream(stream: object, device: torch.device) -> None:
    """Queue ~50 ms of sleep on ``stream`` (CUDA; nothing on the CPU, whose streams are no-ops):
    whatever the engine queues there next runs that late, long after the host has gone on
    (the finish worker updates a state of these models in microseconds). The top clock rate
    makes it at least that long."""
    if device.type == "cuda":
        assert isinstance(stream, torch.cuda.Stream)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(50 * torch.cuda.get_device_properties(device).clock_rate))  # kHz: cycles per ms


def _reference_step(
    reference: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, float]:
    """PyTorch's step on ``batch``, clipped at 1.0: its loss and the gradient norm before
    clipping. The gradients are then zeroed in place (kept: a later step with no backward is
    AdamW on zero gradients)."""
    loss = reference(**batch).loss
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss, norm


# -- step() twice with no backward between ------------------------------------------------------


def step_twice_without_backward(device: torch.device) -> None:
    """Step 1 clips (norm > 1: its update runs behind ``step()``), ``step()`` again with no
    backward (the held gradients are zero: PyTorch's AdamW on zero gradients, whose moments
    still move the weights), then a third step with a backward: the losses and weights as
    PyTorch's.

    The race this orders: the second ``step()`` settles step 1's update, which queues the
    refresh of the resident parameters' device copy on the compute stream, then starts its
    own update of the host weights that copy reads. The compute stream is held back 50 ms
    first, so without the host's wait for it the copy would read the second update's weights:
    right after the second ``step()`` the device copy must hold step 1's weights (its slots
    against PyTorch's after step 1, within the parity bound; the second update moves them by
    0.7% relative, 3500 times the bound). On the CPU the copy is the host buffer itself
    (``aliases_host``): checked there only under the race checker, which keeps it apart."""
    engine, reference, optimizer = _side_by_side(ds_config(clipping=1.0, megatrain=HOST_STATE), device)
    try:
        batch = _batch(0, device)
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        reference_loss, norm = _reference_step(reference, optimizer, batch)
        assert norm > 1.0  # clipped: pipelined
        assert math.isclose(loss.item(), reference_loss.item(), rel_tol=LOSS_RTOL)
        after_first = {name: value.clone() for name, value in reference.state_dict().items()}
        assert engine.pipelined_finish is not None and engine.pipelined_finish.in_flight, "no update behind step()"

        _delay_stream(engine.runtime.compute_stream(), device)
        engine.step()  # no backward since the last step()
        assert engine.pipelined_finish.in_flight  # the second update too: nothing refreshes the copy after it
        engine.runtime.compute_stream().synchronize()  # the refresh has run; the test reads the copy next
        resident = engine.resident
        if not resident.aliases_host:
            copied = {
                s.name: resident.device_flat[s.offset : s.offset + s.numel].view(s.shape)
                for s in resident.state.layout.slots
            }
            assert relative_error(copied, {name: after_first[name] for name in copied}) < WEIGHT_RTOL
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # the reference's second step:
        optimizer.step()  # on the zero gradients _reference_step left

        batch = _batch(1, device)
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        reference_loss, _ = _reference_step(reference, optimizer, batch)
        assert math.isclose(loss.item(), reference_loss.item(), rel_tol=LOSS_RTOL)
        assert engine.optimizer_steps == 3
        assert relative_weight_error(engine, reference) < WEIGHT_RTOL
    finally:
        engine.destroy()


def test_step_twice_without_backward_on_cuda():
    step_twice_without_backward(CUDA)


# -- the evaluation-only engine ------------------------------------------------------------------

EVAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EVAL_LOSS_RTOL = {"fp32": LOSS_RTOL, "bf16": 1e-2}
"""fp32: the parity bound (module docstring). bf16: the engine runs the model's own modules on
the same bf16 weights as the reference, but its weights sit in flat buffers at other offsets,
and cuBLAS may pick another kernel (another summation order) for another alignment: each
product may round to a neighbouring bf16 value (2^-8 relative), as in ``test_gpu.py``'s bf16
tests, whose 1e-2 per loss this takes. On the CPU the losses are bit-equal
(``tests/test_evaluation_only.py``); not asserted here."""


def _cast_like_the_engine(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy of ``model`` in ``eval()`` with its parameters (not its buffers) in ``dtype``,
    as ``tests/test_evaluation_only.py``'s reference (not imported from there: its imports
    reach the data-parallel launchers, and a collection error would stop the GPU step)."""
    reference = copy.deepcopy(model).eval()
    for param in reference.parameters():
        param.data = param.data.to(dtype)
    return reference


def evaluation_only(device: torch.device, precision: str, device_state: str) -> None:
    """``deepspeed.initialize(model=..., config=...)`` with no optimizer: each evaluation loss
    as plain PyTorch's on the same device, its parameters cast to the compute dtype (the
    buffers kept, as the engine holds them); the state dict the
    weights as given, bit for bit (each held exactly in fp32, the default ``"frozen_weights"``);
    ``backward()`` refused. ``device_state`` "auto" (the default) or "none": no optimizer
    state either way, the weights streamed or kept as the placement decides."""
    import deepspeed

    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=3)
    reference = _cast_like_the_engine(model, EVAL_DTYPES[precision])
    reference.to(device)
    given = {key: value.clone() for key, value in model.state_dict().items()}
    config = {
        "engine": "megatrain",
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": precision == "bf16"},
        "megatrain": {"device_state": device_state},
    }
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=config)
    try:
        assert optimizer is None and engine.runtime.device.type == device.type
        engine.eval()
        for seed in (0, 1):
            batch = _batch(seed, device)
            with torch.no_grad():
                ours, theirs = engine(**batch).loss, reference(**batch).loss
            assert math.isclose(float(ours), float(theirs), rel_tol=EVAL_LOSS_RTOL[precision]), (seed, ours, theirs)
        state = cast(torch.nn.Module, engine.module).state_dict()
        assert state.keys() == given.keys()
        assert all(torch.equal(state[key].cpu(), value) for key, value in given.items())
        with pytest.raises(RuntimeError, match="needs an optimizer"):
            engine.backward(engine(**_batch(0, device)).loss)
    finally:
        engine.destroy()


@pytest.mark.parametrize("device_state", ["auto", "none"])
@pytest.mark.parametrize("precision", list(EVAL_DTYPES))
def test_evaluation_only_engine_on_cuda(precision, device_state):
    evaluation_only(CUDA, precision, device_state)


# -- a forward between a step's last backward and step() ----------------------------------------


def _forward_warns(engine: MegatrainEngine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The loss of a forward, and whether it warned that the weights are changing under it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = engine(**batch).loss
    return loss, any("before this forward" in str(w.message) for w in caught)


def _micro_batch(engine: MegatrainEngine, reference: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """One micro-batch of 2 on both (the reference's loss halved, as ``engine.backward`` does):
    the same loss, and the engine's forward warns of nothing (it is not after a last backward)."""
    loss, warning = _forward_warns(engine, batch)
    assert not warning
    engine.backward(loss)
    reference_loss = reference(**batch).loss
    (reference_loss / 2).backward()
    assert math.isclose(loss.item(), reference_loss.item(), rel_tol=LOSS_RTOL)


def forward_before_step(device: torch.device, clipping: float, megatrain: dict, warned: bool) -> None:
    """Three steps of 2 micro-batches: a forward between the micro-batches (never warned:
    nothing is updated before the last backward), and in the second and third steps a forward
    after the last backward, before ``step()``: warned exactly where the worker updates during
    backward (``tests/test_speculative_step.py``'s cases). Training is unaffected (those
    forwards only read): every loss and the weights as PyTorch's on the same micro-batches.

    Where nothing is updated before ``step()`` (no warning) that forward reads the weights
    before the step: its loss, read after ``step()`` as a script logging it would, is
    PyTorch's before its ``optimizer.step()`` (on the step's last micro-batch, whose loss the
    step moves by ~1e-2 relative, 1000 times the bound; another batch's moved by 6e-6 in one
    step). On CUDA the h2d stream is held back 50 ms before that forward, so its weight copies
    run after ``step()`` has begun, and would read host weights the update is writing had
    ``step()`` not waited for them; and the blocks it copied ahead for its backward, which
    never comes, would give the next forward the weights before the update had ``step()`` not
    dropped them (engine.py ``_before_update``; both found by this flow under the CPU
    race checker, 2026-11-28, where ``tests/test_speculative_step.py`` runs it). Where the
    worker updates during backward the forward mixes old and new weights (what the warning
    says): its loss is not checked.
    """
    config = ds_config(
        accumulation=2, clipping=clipping, megatrain={"optimizer_device": "cpu", **HOST_STATE, **megatrain}
    )
    engine, reference, optimizer = _side_by_side(config, device, num_layers=2)
    try:
        for step in range(3):
            _micro_batch(engine, reference, _batch(2 * step, device))
            assert not _forward_warns(engine, _batch(100 + step, device))[1]  # between micro-batches
            engine.step()
            _micro_batch(engine, reference, _batch(2 * step + 1, device))
            if step == 0:
                engine.step()
            else:  # a forward after the step's last backward
                probe = _batch(2 * step + 1, device)  # the step's own: the step moves its loss ~1e-2
                _delay_stream(engine.runtime.h2d_stream, device)
                probe_loss, warning = _forward_warns(engine, probe)
                engine.step()
                assert warning is warned, step
                with torch.no_grad():
                    before_step = reference(**probe).loss
                if not warned:
                    assert math.isclose(probe_loss.item(), before_step.item(), rel_tol=LOSS_RTOL), step
            if clipping > 0:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), clipping)
            optimizer.step()
            optimizer.zero_grad()
        assert relative_weight_error(engine, reference) < WEIGHT_RTOL
    finally:
        engine.destroy()


FORWARD_BEFORE_STEP = [
    (0.0, {}, True),  # nothing held: the worker updates every chunk during backward
    (1e6, {"speculative_blocks": 1}, True),  # the journaled block, speculated (never clipped)
    (1e6, {"speculative_blocks": 0}, False),  # every range waits for step()
]


@pytest.mark.parametrize(
    ("clipping", "megatrain", "warned"), FORWARD_BEFORE_STEP, ids=["nothing-held", "speculated", "waits-for-step"]
)
def test_a_forward_before_step_on_cuda(clipping, megatrain, warned):
    forward_before_step(CUDA, clipping, megatrain, warned)


# -- the pipelined finish with every state on the host ------------------------------------------


def state_dict_right_after_step(device: torch.device) -> None:
    """Two clipped steps (norm > 1: every state updated behind ``step()`` by the finish
    worker, slowed 20 ms a state so that the update is certainly in flight), ``state_dict()``
    read right after each: it waits for the update, so every tensor, copied as soon as it
    returns, is PyTorch's after the same step (the parity bound; the update still to land
    moves the weights by ~1e-2 relative). On CUDA the resident parameters'
    device copy is refreshed as their update lands, and the next step's losses (read from the
    weights streamed after the update) are PyTorch's too."""
    engine, reference, optimizer = _side_by_side(ds_config(clipping=1.0, megatrain=HOST_STATE), device)
    slow_finish_worker(engine, 0.02)
    try:
        assert engine.pipelined_finish is not None
        for step in range(2):
            batch = _batch(step, device)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            assert engine.pipelined_finish.in_flight, step
            saved = {key.removeprefix("module."): value.clone() for key, value in engine.state_dict().items()}
            reference_loss, norm = _reference_step(reference, optimizer, batch)
            assert norm > 1.0, step  # clipped
            assert math.isclose(loss.item(), reference_loss.item(), rel_tol=LOSS_RTOL), step
            expected = reference.state_dict()
            assert saved.keys() == expected.keys()
            assert relative_error(saved, expected) < WEIGHT_RTOL, step
    finally:
        engine.destroy()


def test_a_state_dict_right_after_a_pipelined_step_on_cuda():
    state_dict_right_after_step(CUDA)
