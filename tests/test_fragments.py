"""``"megatrain": {"fragment_bytes": ...}``: blocks' weights copied in pieces, each with its event.

On the CPU nothing is copied (blocks compute on their host buffers), so these tests run the
GPU's path: ``DeviceRuntime.shares_host_memory`` off, weights copied into device slots and
gradients staged, as on a GPU but with synchronous copies. Parity tolerances as in
``test_parity.py`` (fp32: 1e-5 per-step loss, 2e-6 global weight error after 5 steps).
"""

import pytest
import tiny_models
from side_by_side import ds_config, train_side_by_side
from test_parity import assert_parity

from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.state.flat_layout import ALIGN_ELEMENTS, build_flat_layout
from megatrain_ds.streaming.weight_fragments import plan_fragments


def test_pieces_cover_the_buffer_in_the_order_parts_are_used():
    layout = build_flat_layout([("a.w", (100,), 0), ("b.w", (300,), 0), ("c.w", (10,), 1)])
    parts = [[], ["a.w"], ["b.w"], ["c.w"]]
    plan = plan_fragments(layout, parts, fragment_elements=100, part_order=[0, 3, 1, 2])
    size = 2 * ALIGN_ELEMENTS  # 100 elements round up to whole alignment units
    assert sorted(plan.ranges) == [(start, min(start + size, layout.numel)) for start in range(0, layout.numel, size)]
    for names, fragments in zip(parts, plan.part_fragments):
        for name in names:
            slot = layout.slot(name)
            covered = [plan.ranges[i] for i in fragments]
            assert all(any(lo <= e < hi for lo, hi in covered) for e in range(slot.offset, slot.offset + slot.numel))
    # By hand: a at [0, 100), b at [128, 428), c (its own group) at [448, 458); pieces of 128.
    # c is used first: its piece crosses first, then a's, then b's that have not crossed yet.
    assert plan.ranges == ((384, 512), (0, 128), (128, 256), (256, 384))
    assert plan.part_fragments == ((), (1,), (0, 2, 3), (0,))


def _copying(monkeypatch):
    monkeypatch.setattr(DeviceRuntime, "shares_host_memory", property(lambda self: False))


@pytest.mark.parametrize("family, recompute", [("llama", "full"), ("llama", "none"), ("gpt2", 2), ("mixtral", "full")])
def test_fragments_on_and_off_match_pytorch_with_the_same_bytes(family, recompute, monkeypatch):
    _copying(monkeypatch)
    copied = {}
    for fragment_bytes in (None, 4096):
        config = ds_config(
            accumulation=2,
            megatrain={"recompute": recompute, "checkpoint_interval": 2, "fragment_bytes": fragment_bytes},
        )
        engine, reference, trace = train_side_by_side(tiny_models.FAMILIES[family], config)
        try:
            assert_parity(engine, reference, trace)
            copied[fragment_bytes] = engine.streamer.bytes_copied
            plans = engine.streamer._plans
            if fragment_bytes:
                # every block crossed in pieces after the first forward taught its template its parts
                assert sorted(plans) == [0, 1, 2, 3] and all(len(plan.ranges) > 1 for plan in plans.values())
            else:
                assert not plans
        finally:
            engine.destroy()
    assert copied[None] == copied[4096] > 0


def test_the_first_piece_holds_the_first_module_used(monkeypatch):
    """Llama registers self_attn, mlp, then the norms, but runs input_layernorm first: the
    first piece copied holds its weight, and parts are waited on in the order used."""
    _copying(monkeypatch)
    config = ds_config(megatrain={"fragment_bytes": 4096})
    engine, _, _ = train_side_by_side(tiny_models.llama, config, steps=2)
    try:
        template = engine.blocks.templates[0]
        parts, order = template.parts_in_use()
        named = [parts[i] for i in order if parts[i]]
        assert [names[0].split(".")[0] for names in named] == [
            "input_layernorm",
            "self_attn",
            "post_attention_layernorm",
            "mlp",
        ]
        plan = engine.streamer._plans[0]
        first = engine.states[0].layout.slot("input_layernorm.weight")
        assert plan.ranges[0][0] <= first.offset < plan.ranges[0][1]
    finally:
        engine.destroy()
