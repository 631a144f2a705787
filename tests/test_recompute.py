"""``"megatrain": {"recompute": ...}``: blocks that stash their activations instead of
recomputing, checked against plain PyTorch (tolerances as in ``test_parity.py``: fp32 on
the CPU, 1e-5 relative per-step loss, 2e-6 global relative weight error after 5 steps;
a stashed block's backward runs the very graph its forward built, so it is no further
from the reference than a recomputed one).
"""

import pytest
import tiny_models
import torch
from side_by_side import ds_config, train_side_by_side
from test_parity import assert_parity
from test_trace import _spans
from torch import nn

import megatrain_ds.engine_build
from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.planning import planner, recompute_policy
from megatrain_ds.planning.preflight import AvailableMemory, InsufficientMemoryError
from megatrain_ds.runtime.device_runtime import DeviceRuntime, PinnedPool
from megatrain_ds.streaming.activation_stash import ActivationStash

STEPS = 5


def _train(family, recompute, accumulation, checkpoint_interval, **megatrain):
    config = ds_config(
        accumulation=accumulation,
        clipping=1.0,
        megatrain={"recompute": recompute, "checkpoint_interval": checkpoint_interval, **megatrain},
    )
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


def _auto_sees_room_for(monkeypatch, blocks):
    """Make "auto" see the host memory that holds ``blocks`` blocks' stash by its own
    estimate (and half a block more), after the step's transients where the device is the
    host: on the CPU nothing crosses a link and only memory limits the stash, so it stashes
    the first ``blocks`` blocks and recomputes the others."""
    choose = megatrain_ds.engine_build.choose_recompute

    def with_room(runtime, config, run, host_memory_left=None):
        shape, settings, hardware = run
        transients = sum(planner.gpu_bytes(shape, settings, hardware).values())
        if not hardware.shares_host_memory:
            transients = 0
        stash = (blocks + 0.5) * planner.stash_bytes_per_block(shape, settings)
        room = (transients + stash) / planner.STASH_HOST_FRACTION
        return choose(runtime, config, run, host_memory_left=int(room))

    monkeypatch.setattr(megatrain_ds.engine_build, "choose_recompute", with_room)


# With "none" above (GA 2, K 2) every family also runs "auto" (GA 1, K 1) and an integer
# (GA 2, K 1): each setting, GA 1 and 2, and K 1 and 2 on every family.
@pytest.mark.parametrize("recompute, accumulation, checkpoint_interval", [("auto", 1, 1), (2, 2, 1)])
@pytest.mark.parametrize("family", sorted(tiny_models.FAMILIES))
def test_auto_and_integer_recompute_match_pytorch_on_every_family(
    family, recompute, accumulation, checkpoint_interval, monkeypatch, cpu_single_thread
):
    """Shown room for 3 blocks' stash, "auto" stashes 3 and recomputes the last block; 2
    recomputes the last two blocks and stashes the first two: stashed and recomputed
    blocks in one model, on every family (GPT-2: dropout, replayed in the recomputed
    blocks, kept in the stashed ones' graphs)."""
    _auto_sees_room_for(monkeypatch, 3)
    engine, reference, trace = _train(family, recompute, accumulation, checkpoint_interval)
    try:
        _check(engine, reference, trace, accumulation, stashed=3 if recompute == "auto" else 2)
        if recompute == "auto":
            assert engine.recompute_choice.predicted["auto"]["stashed_blocks"] == 3
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "recompute, stashed, accumulation, checkpoint_interval",
    [
        (recompute, stashed, accumulation, interval)
        for recompute, stashed, pairs in [
            ("none", 4, ((1, 1), (2, 2))),
            ("auto", 4, ((1, 2), (2, 1))),
            (1, 3, ((1, 2), (2, 1))),
            (3, 1, ((1, 1), (2, 2))),
        ]
        for accumulation, interval in pairs
    ],
)
def test_stash_and_recompute_mixed(recompute, stashed, accumulation, checkpoint_interval):
    """An integer N recomputes the last N blocks and stashes the others (GPT-2: dropout,
    so a recomputed block's replayed masks and a stashed block's own must both agree);
    "auto" stashes every block of a tiny model (its stash is a few hundred kB).

    Each setting with accumulation 1 and 2 and checkpoint interval 1 and 2, in two of their
    four pairings, each pairing for two settings ("none" and "auto" take opposite ones:
    both stash every block). The full product ran each pairing four times over for the
    same evidence."""
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
        engine = MegatrainEngine(
            tiny_models.llama(), parse_engine_config(ds_config(megatrain={"recompute": recompute}))
        )
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


@pytest.mark.parametrize("in_place", [True, False])
def test_stash_keeps_activations_and_repoints_weight_views(in_place):
    """A saved view of the weight buffer is not stashed: backward gets a view of the weights
    acquired for it (here a different buffer, as a GPU's other slot would be), and the
    gradients equal plain autograd's. ``in_place=False`` runs a GPU's path on the CPU:
    copies into pooled host buffers and back into fresh "device" tensors."""
    runtime = DeviceRuntime.create(torch.device("cpu"))
    stash = ActivationStash(runtime)
    stash.in_place = in_place
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
    assert stash.pool.nbytes == (0 if in_place else block.nbytes)


def _copying_stashes(monkeypatch):
    """Make every ``ActivationStash`` take the GPU's path (copies); returns those created."""
    created = []
    original = ActivationStash.__init__

    def copying(self, runtime):
        original(self, runtime)
        self.in_place = False
        created.append(self)

    monkeypatch.setattr(ActivationStash, "__init__", copying)
    return created


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2_moe"])
def test_stash_through_copies_matches_pytorch(family, monkeypatch):
    """The GPU's path on the CPU: every stashed storage is copied to a pooled host buffer
    and back (``in_place`` off), views rebuilt from the copies; the pool is reused from
    the second step on (its size stays that of one step's stash)."""
    created = _copying_stashes(monkeypatch)
    engine, reference, trace = _train(family, "none", accumulation=2, checkpoint_interval=2)
    try:
        _check(engine, reference, trace, accumulation=2, stashed=4)
        (stash,) = created
        assert stash.pool.nbytes == sum(stash.block_bytes.values())
    finally:
        engine.destroy()


def _first_step(recompute, monkeypatch, host_left):
    monkeypatch.setattr(recompute_policy, "available_memory", lambda device: AvailableMemory(host=host_left))
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(megatrain={"recompute": recompute})))
    loss = engine(**tiny_models.make_batch(0)).loss
    engine.backward(loss)
    engine.step()
    return engine


@pytest.mark.parametrize("host_left, stashed", [(1 << 40, 4), (1 << 10, 0)])
def test_auto_stashes_every_block_when_host_memory_is_ample_and_none_when_it_is_not(
    monkeypatch, host_left, stashed, caplog
):
    caplog.set_level("INFO", logger="megatrain_ds.planning.recompute_policy")
    engine = _first_step("auto", monkeypatch, host_left)
    try:
        assert engine.stashed_blocks == stashed
        assert sorted(engine.blocks.stash.block_bytes) == list(range(stashed))
        assert engine.recompute_choice.predicted["auto"]["stashed_blocks"] == stashed
        assert [r.getMessage() for r in caplog.records if "recompute auto" in r.getMessage()] == [
            next(r.getMessage() for r in caplog.records if "recompute auto" in r.getMessage())
        ]
        assert f"{stashed} of 4 blocks stash" in caplog.text
    finally:
        engine.destroy()


def test_a_stash_that_cannot_fit_fails_with_the_setting_that_would(monkeypatch):
    # The planner's estimate for tiny Llama at 2 x 12 tokens, fp32: (8*32 + 2*16 + 4*48) * 24 * 4.
    per_block = (8 * 32 + 2 * 16 + 4 * 48) * 24 * 4
    with pytest.raises(InsufficientMemoryError, match=r'stashes 4 blocks.*stash at most 1 blocks \("recompute": 3\)'):
        _first_step("none", monkeypatch, per_block + 1)


def test_stash_traffic_has_its_own_trace_track(tmp_path):
    """Each traced step shows every stashed block's stash (after its forward) and unstash
    (before its backward) on the "stash" track, with the bytes the stash measured."""
    path = tmp_path / "trace.json"
    torch.manual_seed(0)
    engine = MegatrainEngine(
        tiny_models.llama(),
        parse_engine_config(ds_config(megatrain={"recompute": 2, "trace": str(path), "trace_steps": 2})),
    )
    try:
        for step in range(4):
            engine.backward(engine(**tiny_models.make_batch(step)).loss)
            engine.step()
        measured = engine.blocks.stash.block_bytes
    finally:
        engine.destroy()
    document, spans = _spans(path)
    assert document["otherData"]["recompute"]["setting"] == 2
    assert document["otherData"]["recompute"]["stashed_blocks"] == 2
    names = sorted(span["name"] for span in spans["stash"])
    assert names == sorted(2 * [f"stash {b}" for b in (0, 1)] + 2 * [f"unstash {b}" for b in (0, 1)])
    assert all(span["args"]["bytes"] == measured[span["args"]["block"]] for span in spans["stash"])
    for step in {span["args"]["step"] for span in spans["stash"]}:
        ends = {span["name"]: span["ts"] for span in spans["stash"] if span["args"]["step"] == step}
        forwards = {span["name"]: span["ts"] for span in spans["compute"] if span["args"]["step"] == step}
        # stash after the block's forward, unstash before its backward
        assert ends["stash 1"] >= forwards["forward 1"] and ends["unstash 1"] <= forwards["backward 1"]


def test_pinned_pool_reuses_buffers_best_fit_within_its_slack():
    runtime = DeviceRuntime.create(torch.device("cpu"))
    pool = PinnedPool(runtime)
    first, small = pool.take(1000), pool.take(400)
    pool.give(first)
    pool.give(small)
    assert pool.take(900) is first  # 1000 <= 1.25 * 900
    assert pool.take(700) is not small  # 400 is too small, and nothing else is free
    assert pool.take(380) is small
    assert pool.nbytes == 1000 + 400 + 700


def test_a_forward_without_backward_gives_its_stash_back(monkeypatch):
    """A training forward whose backward never runs (evaluation with grad on, an error in
    the loss) leaves nothing held: the next forward returns its pinned buffers to the pool,
    which then serves the next stash without growing."""
    created = _copying_stashes(monkeypatch)
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(megatrain={"recompute": "none"})))
    try:
        engine(**tiny_models.make_batch(0))  # no backward
        (stash,) = created
        allocated = stash.pool.nbytes
        assert allocated == sum(stash.block_bytes.values()) > 0
        engine.backward(engine(**tiny_models.make_batch(0)).loss)
        engine.step()
        assert stash.pool.nbytes == allocated and stash.host_bytes == 0
    finally:
        engine.destroy()
