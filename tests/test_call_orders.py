"""Call orders user scripts make around training, under the CPU race checker, against PyTorch.

On the CPU the engine computes on the host weights in place, so an ordering bug between the
device's copies and the host optimizer's writes shows only on a GPU -- or under the race
checker (the ``stream_check`` fixture), whose "device" is apart from the host: real copies on
virtual streams, and ``StreamRaceError`` on an access no synchronisation orders. Each flow here
makes the calls a DeepSpeed / Accelerate / HF Trainer / TRL script makes (an evaluation pass, a
greedy generation loop, a state dict or checkpoint mid-step) on the engine and on plain PyTorch
(``torch.optim.AdamW``, ``clip_grad_norm_``) side by side.

Tolerances: the parity suite's (``test_parity.py``: 1e-5 relative per loss, 2e-6 relative
weight error): the same ops on the same values, but the order the matmul kernels sum in and
the engine's norm summed per block.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest
import torch
from side_by_side import ds_config, relative_error, relative_weight_error
from test_gpu_flows import HOST_STATE, _batch, _side_by_side
from test_parity import LOSS_RTOL, WEIGHT_RTOL

from megatrain_ds import MegatrainEngine

CPU = torch.device("cpu")
CLIPPING = 1.0
"""Clips every step of this llama: each update runs behind ``step()`` (pipelined), and only the
first step speculates (a clipped step predicts another: optimizer/speculative_step.py)."""
NEVER_CLIPS = 1e6
"""Clips no step: every step speculates, the worker updating the journaled ranges during backward."""


@dataclass
class SideBySide:
    """The engine and plain PyTorch making the same calls, DeepSpeed's way (``step()`` after
    every micro-batch, the optimizer stepping at the accumulation boundary)."""

    engine: MegatrainEngine
    reference: torch.nn.Module
    optimizer: torch.optim.Optimizer
    accumulation: int
    clipping: float

    def forward_backward(self, seed: int) -> None:
        """A training micro-batch's forward and backward on both: the same loss."""
        batch = _batch(seed, CPU)
        loss = self.engine(**batch).loss
        self.engine.backward(loss)
        reference_loss = self.reference(**batch).loss
        (reference_loss / self.accumulation).backward()
        assert math.isclose(loss.item(), reference_loss.item(), rel_tol=LOSS_RTOL), seed

    def step(self) -> None:
        """``engine.step()``; at the boundary the reference's clipped AdamW step."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        if boundary:
            if self.clipping > 0:  # DeepSpeed's 0: no clipping
                torch.nn.utils.clip_grad_norm_(self.reference.parameters(), self.clipping)
            self.optimizer.step()
            # Zeros, not None: a step() with no backward since is AdamW on zero gradients on both.
            self.optimizer.zero_grad(set_to_none=False)

    def evaluate(self, seed: int) -> None:
        """The Trainer's evaluation: ``eval()``, a no-grad forward, ``train()``; the same loss."""
        batch = _batch(seed, CPU)
        self.engine.eval()
        self.reference.eval()
        with torch.no_grad():
            ours, theirs = self.engine(**batch).loss, self.reference(**batch).loss
        self.engine.train()
        self.reference.train()
        assert math.isclose(ours.item(), theirs.item(), rel_tol=LOSS_RTOL), seed

    def generate(self, seed: int, new_tokens: int = 3) -> None:
        """TRL's generation mid-training: a greedy loop of no-grad forwards of growing length,
        in ``eval()``; the same tokens and last logits."""
        tokens = _batch(seed, CPU)["input_ids"][:, :6]
        self.engine.eval()
        self.reference.eval()
        with torch.no_grad():
            for _ in range(new_tokens):
                ours = self.engine(input_ids=tokens).logits[:, -1]
                theirs = self.reference(input_ids=tokens).logits[:, -1]
                torch.testing.assert_close(ours, theirs, rtol=LOSS_RTOL, atol=LOSS_RTOL)
                tokens = torch.cat([tokens, theirs.argmax(-1, keepdim=True)], dim=1)
        self.engine.train()
        self.reference.train()

    def assert_same_weights(self) -> None:
        assert relative_weight_error(self.engine, self.reference) < WEIGHT_RTOL


def side_by_side(accumulation: int = 2, clipping: float = CLIPPING, **megatrain) -> SideBySide:
    """A 2-block Llama, every optimizer state on the host (the default keeps a tiny model's
    states on the device, where nothing is updated behind ``step()`` or during backward)."""
    config = ds_config(accumulation=accumulation, clipping=clipping, megatrain={**HOST_STATE, **megatrain})
    engine, reference, optimizer = _side_by_side(config, CPU, num_layers=2)
    return SideBySide(engine, reference, optimizer, accumulation, clipping)


def _saved(engine: MegatrainEngine) -> list[dict[str, torch.Tensor]]:
    """``engine.state_dict()`` and ``engine.module.state_dict()``, copied as they return."""
    ours = {key.removeprefix("module."): value.clone() for key, value in engine.state_dict().items()}
    return [ours, {key: value.clone() for key, value in engine.module.state_dict().items()}]


TIERS = {"host": {}, "nvme-optimizer": {"nvme_offload": "optimizer"}, "nvme-all": {"nvme_offload": "all"}}


@pytest.mark.parametrize("tier", list(TIERS))
def test_state_dict_and_checkpoint_mid_step_hold_the_weights_before_the_step(stream_check, tmp_path, tier):
    """``state_dict()``, ``module.state_dict()`` and ``save_checkpoint`` between micro-batches
    and between a step's last backward and ``step()`` (in the second step after a forward
    there too): each holds the weights before the step, as DeepSpeed's engine does, and
    training goes on as PyTorch's. No step is clipped, so every step speculates: the worker
    has updated the journaled ranges during the last backward, and the engine undoes that
    before the state is read (engine.py ``_withdraw_speculation``; before, those ranges read
    updated, 2e-3 relative weight error, 1000 times the bound, and a checkpoint taken there
    held them beside the gradients that step them again). After a forward whose backward never
    comes, the last checkpoint is loaded back and its ``step()`` redone: the same weights again.
    A forward after the withdrawal is not warned of changing weights: none change before ``step()``.
    With the NVMe tier too (the journal's restore brings the states in: "optimizer"; the
    weights there as well: "all")."""
    nvme = {"nvme_path": str(tmp_path / "swap"), "nvme_window_blocks": 2} if TIERS[tier] else {}
    pair = side_by_side(clipping=NEVER_CLIPS, **TIERS[tier], **nvme)
    try:
        for step in range(2):
            pair.forward_backward(2 * step)
            between = _saved(pair.engine)
            if step == 0:
                pair.engine.save_checkpoint(str(tmp_path), tag="between")
            pair.step()
            pair.forward_backward(2 * step + 1)
            if step == 1:
                pair.engine(**_batch(50, CPU))  # dropped: its backward never comes
            before_step = _saved(pair.engine)
            if step == 1:
                pair.engine.save_checkpoint(str(tmp_path), tag="before")
            else:  # the speculation withdrawn, nothing changes before step(): a forward is not warned
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    pair.engine(**_batch(51, CPU))  # dropped too
            expected = pair.reference.state_dict()
            for saved in [*between, *before_step]:
                assert relative_error(saved, expected) < WEIGHT_RTOL, step
            pair.step()
        pair.assert_same_weights()
        after = {key: value.clone() for key, value in pair.engine.module.state_dict().items()}
        pair.engine(**_batch(60, CPU))  # dropped: load_checkpoint drops the blocks it copied ahead
        pair.engine.load_checkpoint(str(tmp_path), tag="before")
        pair.engine.step()  # the saved step's last micro-batch done: its step() again
        assert relative_error(pair.engine.module.state_dict(), after) < WEIGHT_RTOL
    finally:
        pair.engine.destroy()


def test_evaluation_and_generation_mid_training(stream_check):
    """What Accelerate, the HF Trainer and TRL call between training calls: an evaluation pass
    (``eval()``, no-grad forwards, ``train()``) between the micro-batches of a window and right
    after ``step()`` while its update runs behind it; a greedy generation loop of no-grad
    forwards of growing length; ``zero_grad()`` on the engine and its optimizer where
    Accelerate and the Trainer call them; and a window ended early with
    ``set_gradient_accumulation_boundary(True)`` (Accelerate's end of the dataloader). Every
    loss, logit and the weights as PyTorch's on the same calls. (``"device_state": "auto"``
    places no state on the CPU checker's device: the same path as "none", so not run.)"""
    pair = side_by_side(accumulation=3)
    try:
        for step in range(3):
            pair.engine.zero_grad()
            pair.engine.optimizer.zero_grad()
            pair.engine.set_gradient_accumulation_boundary(False)  # as Accelerate sets it every micro-batch
            pair.forward_backward(2 * step)
            pair.engine.optimizer.zero_grad()  # Accelerate's prepared optimizer mid-window: a no-op
            pair.step()
            pair.evaluate(100 + step)  # between micro-batches
            pair.engine.set_gradient_accumulation_boundary(True)  # the window ends after 2 of 3
            pair.forward_backward(2 * step + 1)
            pair.step()
            pair.evaluate(200 + step)  # right after step(): its update behind it
            pair.generate(300 + step)
        pair.assert_same_weights()
    finally:
        pair.engine.destroy()


def test_a_dropped_forward_then_step_without_backward(stream_check):
    """A forward whose loss is dropped, then ``step()`` with no backward since (AdamW on zero
    gradients): the update waits for that forward's reads, and the blocks it copied ahead for
    its backward are not the next forward's weights (engine.py ``_before_update``). Every loss
    and the weights as PyTorch's on the same calls; each update runs behind ``step()``
    (clipping 1.0, one micro-batch a step)."""
    pair = side_by_side(accumulation=1)
    try:
        for step in range(3):
            pair.forward_backward(step)
            pair.step()
            pair.engine(**_batch(50 + step, CPU))  # dropped: its backward never comes
            pair.step()
        pair.assert_same_weights()
    finally:
        pair.engine.destroy()
