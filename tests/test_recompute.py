"""``"megatrain": {"recompute": ...}``: blocks that stash their activations instead of
recomputing, checked against plain PyTorch (tolerances as in ``test_parity.py``: fp32 on
the CPU, 1e-5 relative per-step loss, 2e-6 global relative weight error after 5 steps;
a stashed block's backward runs the very graph its forward built, so it is no further
from the reference than a recomputed one).
"""

import pytest
import torch
from torch import nn

import tiny_models
from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.streaming.activation_stash import ActivationStash
from side_by_side import ds_config, train_side_by_side
from test_parity import assert_parity

STEPS = 5


def _train(family, recompute, accumulation, checkpoint_interval, **megatrain):
    config = ds_config(accumulation=accumulation, clipping=1.0,
                       megatrain={"recompute": recompute, "checkpoint_interval": checkpoint_interval, **megatrain})
    return train_side_by_side(tiny_models.FAMILIES[family], config, steps=STEPS)


def _check(engine, reference, trace, accumulation, stashed):
    assert_parity(engine, reference, trace)
    assert engine.stashed_blocks == stashed
    assert sorted(engine.blocks.stash.block_bytes) == list(range(stashed))
    # Weights cross host->device twice per micro-batch, stashed or recomputed alike.
    assert dict(engine.streamer.transfers) == {block: 2 * accumulation * STEPS for block in range(4)}


@pytest.mark.parametrize("family", sorted(tiny_models.FAMILIES))
def test_no_recompute_matches_pytorch_on_every_family(family):
    """Every block stashed, accumulation 2, two blocks per checkpoint (the recomputed
    path's segments must not swallow stashed blocks); GPT-2 has dropout on."""
    engine, reference, trace = _train(family, "none", accumulation=2, checkpoint_interval=2)
    try:
        _check(engine, reference, trace, accumulation=2, stashed=4)
    finally:
        engine.destroy()


@pytest.mark.parametrize("checkpoint_interval", [1, 2])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("recompute, stashed", [("none", 4), (1, 3), (3, 1)])
def test_stash_and_recompute_mixed(recompute, stashed, accumulation, checkpoint_interval):
    """An integer N recomputes the last N blocks and stashes the others (GPT-2: dropout,
    so a recomputed block's replayed masks and a stashed block's own must both agree)."""
    engine, reference, trace = _train("gpt2", recompute, accumulation, checkpoint_interval)
    try:
        _check(engine, reference, trace, accumulation, stashed)
    finally:
        engine.destroy()


def test_stashed_blocks_are_run_once_per_micro_batch():
    """No recompute: a stashed block's template runs once per micro-batch, a recomputed
    block's twice (forward, then recompute in backward)."""
    for recompute, runs_per_block in (("full", 2), ("none", 1)):
        torch.manual_seed(0)
        engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(megatrain={"recompute": recompute})))
        try:
            runs = []
            for template in {id(t): t for t in engine.blocks.templates}.values():
                template.module.register_forward_hook(lambda *args: runs.append(1))
            loss = engine(**tiny_models.make_batch(0)).loss
            engine.backward(loss)
            engine.step()
            assert len(runs) == runs_per_block * 4
        finally:
            engine.destroy()


class _Linear(nn.Module):
    def forward(self, x, weight):
        return torch.nn.functional.linear(torch.tanh(x), weight)


def test_stash_keeps_activations_and_repoints_weight_views():
    """A saved view of the weight buffer is not stashed: backward gets a view of the weights
    acquired for it (here a different buffer, as a GPU's other slot would be), and the
    gradients equal plain autograd's."""
    runtime = DeviceRuntime.create(torch.device("cpu"))
    stash = ActivationStash(runtime)
    x = torch.randn(5, 3, requires_grad=True)
    forward_weights, backward_weights = torch.randn(2 * 3 + 1), torch.empty(2 * 3 + 1)
    backward_weights.copy_(forward_weights)
    weight = forward_weights[1:].view(2, 3).detach().requires_grad_(True)
    with stash.block(0, forward_weights) as block:
        out = _Linear()(x, weight)
    forward_weights.zero_()  # the slot is refilled by another block: backward must not read it
    # tanh saves its output (5 x 3 floats), linear its input (the same tensor) and weight view.
    assert block.nbytes == 5 * 3 * 4 and stash.host_bytes == block.nbytes
    block.attach_weights(backward_weights)
    out.sum().backward()
    block.finish()
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = backward_weights[1:].view(2, 3).clone().requires_grad_(True)
    _Linear()(x_ref, w_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(weight.grad, w_ref.grad)
    assert stash.host_bytes == 0
