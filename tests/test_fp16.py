"""fp16 compute with DeepSpeed's loss scaling, against plain PyTorch and DeepSpeed's scaler.

The reference (``side_by_side.Fp16Reference``) is plain PyTorch mixed precision: fp32
masters trained by ``torch.optim.AdamW``, an fp16 compute copy, and DeepSpeed's own
``DynamicLossScaler``/``LossScaler`` built from DeepSpeed's own config model deciding the
scale (DeepSpeed's fp16 engine itself refuses this CPU). The skipped steps and the scale
after every step must be identical.

Tolerances. The engine runs the op-by-op AdamW kernel here (``cpu_adam_kernel: "torch"``,
bit-identical to ``torch.optim.AdamW``): the fp16 forward and backward run the same ops on
the same fp16 values, and dynamic scales are powers of two, so unscaling is exact. Without
clipping the weights are then bit-identical. With clipping the engine's coefficient comes
from a norm summed in float64 chunk by chunk, torch's from fp32 per-tensor norms: they
differ in the last bits, a master can differ by an fp32 ulp, and its fp16 copy can then
round the other way (a 2^-11 ~ 4.9e-4 relative change of that one weight, which every
later step's gradients carry). How far such a flip spreads depends on the CPU: the relative
weight error after the "hysteresis" case (4 applied steps, which moved the weights 2.5e-2
from their initial values) was 6e-7 on an Intel Xeon and 1.2e-5 on an AMD EPYC, 5e-4 of that
distance. A wrong step (skipped, applied twice, stale shadow, wrong learning rate) moves the
weights by a whole step's update, a quarter of the distance. The bound sits between the two:
relative weight error <= 1% of the distance the reference's weights moved
(``MOVED_FRACTION``), 20x above the worst flip measured and 25x below one step. With
DeepSpeed's CPU Adam kernel (its own arithmetic, ulps from torch's) such flips are more
frequent: <= 1e-3 (measured 1.2e-4 after 8 steps), still below one fp16 rounding of every
weight.

Losses. Up to the first applied step both sides run the same fp16 forward on the same
weights: bit-equal on any machine. Without clipping the weights stay bit-identical, and so
do all losses. After an applied step with clipping the weights may differ as above, and
whether they do depends on the CPU (the last bits of a reduction depend on the kernels and
vector widths the CPU gets: an AMD EPYC gave a loss 6.3e-7 relative off at step 7, an Intel
Xeon none): a relative weight error <= 1e-5 turns a few of the forward's fp16 roundings
(2^-11 relative each) the other way, each moving one term of the loss's mean by a fraction
of 2^-11; rel_tol 1e-4 bounds that with margin. The skip decisions and scales stay equal:
a flip needs a scaled gradient within that 1e-5 of fp16's overflow threshold.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import tiny_models
import torch
from side_by_side import ds_config, relative_error, train_fp16_side_by_side

from megatrain_ds import ConfigError, MegatrainEngine, parse_engine_config

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

# The model's own loss (not the engine's chunked one, which sums in another order), so
# that the fp16 forward is the reference's, op for op.
_EXACT = {"loss_chunk_tokens": 0, "cpu_adam_kernel": "torch"}


def _fp16_config(fp16: dict, *, clipping: float, accumulation: int = 1, megatrain: dict | None = None) -> dict:
    config = ds_config(clipping=clipping, accumulation=accumulation, megatrain={**_EXACT, **(megatrain or {})})
    config["fp16"] = {"enabled": True, **fp16}
    return config


def _relative_error(engine, reference) -> float:
    return relative_error(engine.module.state_dict(), reference.master.state_dict())


LOSS_RTOL = 1e-4
"""Losses after a clipped step (see the module's docstring)."""

MOVED_FRACTION = 0.01
"""Weights after clipped steps: the relative error's bound, as a fraction of the relative
distance the reference's weights moved from their initial values (the module's docstring)."""


def _distance_moved(make_model, reference) -> float:
    """The reference's relative distance from the initial weights (``make_model`` under the
    seed ``train_fp16_side_by_side`` builds it with)."""
    torch.manual_seed(0)
    return relative_error(reference.master.state_dict(), make_model().state_dict())


def _micro_steps_on_the_same_weights(skipped: list[bool], accumulation: int, clipping: float) -> int:
    """How many micro-batch losses both sides compute from bit-identical weights: all of them
    without clipping, else those up to the first applied step (its own micro-batches included:
    they run before it)."""
    applied = [step for step, was_skipped in enumerate(skipped) if not was_skipped]
    if clipping == 0 or not applied:
        return len(skipped) * accumulation
    return (applied[0] + 1) * accumulation


CASES = {
    # 2^32: the first steps overflow and the scale comes down (hysteresis 1: halved at once).
    "scale_too_high": ({"initial_scale_power": 32, "hysteresis": 1}, 1.0, 1, 18),
    # Hysteresis 3, window 2: two overflows tolerated at each scale; the scale grows again.
    "hysteresis": ({"initial_scale_power": 21, "hysteresis": 3, "loss_scale_window": 2}, 1.0, 1, 10),
    "consecutive_hysteresis": (
        {"initial_scale_power": 21, "hysteresis": 2, "consecutive_hysteresis": True, "loss_scale_window": 2},
        1.0,
        1,
        10,
    ),
    "accumulation": ({"initial_scale_power": 21, "hysteresis": 1, "loss_scale_window": 3}, 1.0, 2, 8),
    # No clipping: every bit must agree; journal blocks are stepped during backward and undone.
    "no_clipping": ({"initial_scale_power": 21, "hysteresis": 1, "loss_scale_window": 2}, 0.0, 1, 10),
    "static": ({"loss_scale": 128}, 0.0, 1, 6),
}


@pytest.mark.parametrize("case", CASES)
def test_fp16_matches_pytorch_with_deepspeeds_scaler(case):
    fp16, clipping, accumulation, steps = CASES[case]
    config = _fp16_config(fp16, clipping=clipping, accumulation=accumulation, megatrain={"speculative_blocks": 2})
    engine, reference, trace = train_fp16_side_by_side(tiny_models.llama, config, steps=steps)
    try:
        assert trace.engine_skipped == trace.reference_skipped
        assert trace.engine_scales == trace.reference_scales
        assert engine.skipped_steps == sum(trace.reference_skipped)
        if fp16.get("loss_scale", 0) == 0:  # the case exercises what it names: skips, then steps
            assert any(trace.reference_skipped) and not all(trace.reference_skipped), trace.reference_skipped
        same_weights = _micro_steps_on_the_same_weights(trace.reference_skipped, accumulation, clipping)
        assert trace.engine_losses[:same_weights] == trace.reference_losses[:same_weights]
        for ours, theirs in zip(trace.engine_losses[same_weights:], trace.reference_losses[same_weights:]):
            assert math.isclose(ours, theirs, rel_tol=LOSS_RTOL), (trace.engine_losses, trace.reference_losses)
        error = _relative_error(engine, reference)
        if clipping == 0:
            assert error == 0.0
        else:
            moved = _distance_moved(tiny_models.llama, reference)
            assert moved > 0.01 and error <= MOVED_FRACTION * moved, (error, moved)
        state = engine.states[0]
        assert state.master.dtype == torch.float32 and state.shadow is not None
        assert torch.equal(state.shadow, state.master.to(torch.float16)), "shadow is the rounded master"
    finally:
        engine.destroy()


def test_fp16_with_deepspeeds_cpu_adam_stays_within_fp16_rounding():
    config = _fp16_config(
        {"initial_scale_power": 20, "hysteresis": 1}, clipping=1.0, megatrain={"cpu_adam_kernel": "auto"}
    )
    engine, reference, trace = train_fp16_side_by_side(tiny_models.llama, config, steps=8)
    try:
        assert trace.engine_skipped == trace.reference_skipped and any(trace.reference_skipped)
        assert trace.engine_scales == trace.reference_scales
        assert _relative_error(engine, reference) <= 1e-3
    finally:
        engine.destroy()


def _step(engine, seed: int) -> None:
    loss = engine(**tiny_models.make_batch(seed)).loss
    engine.backward(loss)
    engine.step()


def test_overflow_is_exposed_as_deepspeed_does(caplog):
    """``optimizer.overflow`` (Accelerate's ``step_was_skipped``), ``loss_scale``/``cur_scale``,
    ``skipped_steps``, the norm DeepSpeed reports, and no scheduler step after a skip."""
    torch.manual_seed(0)
    config = _fp16_config({"initial_scale_power": 40, "hysteresis": 1}, clipping=1.0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
    engine.lr_scheduler = scheduler
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

    # Accelerate's own property on what its wrapper holds (the wrapper itself needs an Accelerator).
    wrapped = SimpleNamespace(optimizer=engine.optimizer, __has_overflow__=hasattr(engine.optimizer, "overflow"))

    def accelerate_says_skipped() -> bool:
        return DeepSpeedOptimizerWrapper.step_was_skipped.fget(wrapped)

    try:
        assert engine.optimizer.loss_scale == engine.optimizer.cur_scale == 2.0**40
        with caplog.at_level(logging.INFO, logger="megatrain_ds.engine"):
            _step(engine, 0)
        assert engine.optimizer.overflow and not engine.was_step_applied()
        assert accelerate_says_skipped()
        assert engine.skipped_steps == 1 and engine.global_steps == 1 and engine.optimizer_steps == 0
        assert engine.optimizer.loss_scale == 2.0**39
        assert not math.isfinite(engine.get_global_grad_norm())
        assert scheduler.last_epoch == 0, "a skipped step does not step the scheduler (DeepSpeed)"
        assert "fp16 overflow" in caplog.text
        engine.optimizer.cur_scale = 2.0**10  # DeepSpeed's setter
        _step(engine, 1)
        assert not engine.optimizer.overflow and engine.optimizer_steps == 1 and scheduler.last_epoch == 1
        assert not accelerate_says_skipped()
        assert math.isfinite(engine.get_global_grad_norm())
    finally:
        engine.destroy()


def test_overflow_at_the_minimum_scale_raises_deepspeeds_error():
    torch.manual_seed(0)
    config = _fp16_config({"initial_scale_power": 40, "hysteresis": 1, "min_loss_scale": 2**39}, clipping=1.0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    try:
        _step(engine, 0)
        assert engine.optimizer.loss_scale == 2.0**39
        engine.settle_optimizer()  # the host state is read directly
        masters = [state.master.clone() for state in engine.states]
        with pytest.raises(Exception, match="Current loss scale already at minimum"):
            _step(engine, 1)
        for state, master in zip(engine.states, masters):
            assert torch.equal(state.master, master), "the overflowing step was not applied"
    finally:
        engine.destroy()


def test_scaler_state_survives_a_checkpoint_exactly(tmp_path):
    """Save mid-run (the scale lowered, hysteresis partly used), load into a fresh engine,
    go on: scale, hysteresis, skips and every weight as in the uninterrupted run."""
    fp16 = {"initial_scale_power": 21, "hysteresis": 3, "loss_scale_window": 2}
    config = _fp16_config(fp16, clipping=1.0)

    def fresh():
        torch.manual_seed(0)
        return MegatrainEngine(tiny_models.llama(), parse_engine_config(config))

    def record(engine):
        scaler = engine.optimizer.loss_scaler
        return (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis)

    uninterrupted = fresh()
    try:
        for seed in range(4):
            _step(uninterrupted, seed)
        uninterrupted.save_checkpoint(str(tmp_path), tag="mid")
        saved = record(uninterrupted)
        assert uninterrupted.skipped_steps > 0 and saved[3] < 3, saved  # the state is not the initial one
        for seed in range(4, 8):
            _step(uninterrupted, seed)
        expected = (record(uninterrupted), uninterrupted.skipped_steps, uninterrupted.module.state_dict())
    finally:
        uninterrupted.destroy()
    resumed = fresh()
    try:
        resumed.load_checkpoint(str(tmp_path), tag="mid")
        assert record(resumed) == saved
        for seed in range(4, 8):
            _step(resumed, seed)
        assert record(resumed) == expected[0] and resumed.skipped_steps == expected[1]
        for name, tensor in resumed.module.state_dict().items():
            assert torch.equal(tensor, expected[2][name]), name
    finally:
        resumed.destroy()


# -- the "fp16" block -------------------------------------------------------------------------------


def _parse(fp16, **top):
    return parse_engine_config({**ds_config(), "fp16": fp16, **top})


@pytest.mark.parametrize(
    "block",
    [
        {"enabled": True},
        {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 50},
        {"enabled": True, "hysteresis": 4, "consecutive_hysteresis": True, "min_loss_scale": 8},
        {"enabled": True, "loss_scale": 1024.0},
        {"enabled": True, "loss_scale": 64, "loss_scale_window": 0, "min_loss_scale": 0},  # unused when static
    ],
)
def test_keys_defaults_and_scaler_are_deepspeeds(block):
    """Our parsing against DeepSpeed's own config model: the same dynamic scaler arguments
    and static scale, defaults included, and the scaler DeepSpeed's ZeRO optimizer builds."""
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    from megatrain_ds.optimizer.loss_scaling import LossScaling, dynamic_loss_scale_args

    theirs = DeepSpeedFP16Config(**block)
    ours = _parse(block).fp16
    assert ours is not None and ours.loss_scale == theirs.loss_scale and ours.dynamic == (theirs.loss_scale == 0)
    assert dynamic_loss_scale_args(ours) == theirs.dynamic_loss_scale_args()
    scaling = LossScaling(ours)
    assert scaling.scale == (2.0**theirs.initial_scale_power if ours.dynamic else theirs.loss_scale)
    assert type(scaling.scaler).__name__ == ("DynamicLossScaler" if ours.dynamic else "LossScaler")


@pytest.mark.parametrize("fp16", [None, {"enabled": True, "initial_scale_power": 12, "hysteresis": 3}])
def test_the_engines_fp16_getters_answer_as_deepspeeds(fp16):
    """``engine.loss_scale()``, ``dynamic_loss_scale()``, ``initial_dynamic_scale()`` and
    ``dynamic_loss_scale_args()`` of the engine ``deepspeed.initialize`` returns, against
    DeepSpeed's own config model of the same block (its defaults without fp16)."""
    import deepspeed
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    theirs = DeepSpeedFP16Config(**(fp16 or {}))
    config = ds_config() if fp16 is None else {**ds_config(), "fp16": fp16}
    engine, *_ = deepspeed.initialize(model=tiny_models.llama(), config=config)
    try:
        assert engine.loss_scale() == theirs.loss_scale
        assert engine.dynamic_loss_scale() == (theirs.loss_scale == 0)
        assert engine.initial_dynamic_scale() == theirs.initial_dynamic_scale()
        assert engine.dynamic_loss_scale_args() == theirs.dynamic_loss_scale_args()
    finally:
        engine.destroy()


def test_fp16_sets_the_compute_dtype_and_holds_fp32_gradients():
    config = _parse({"enabled": True}, gradient_clipping=0.0)
    assert config.compute_dtype == torch.float16 and config.holds_gradients
    assert config.held_gradient_dtype == torch.float32
    assert _parse({"enabled": "auto"}).fp16 is None  # filled in by the Trainer's --fp16
    assert _parse({"enabled": False, "loss_scale": "auto"}).fp16 is None


@pytest.mark.parametrize(
    "fp16, top, message",
    [
        ({"enabled": True}, {"bf16": {"enabled": True}}, r"fp16.enabled and bf16.enabled are both true"),
        ({"enabled": "yes"}, {}, r'fp16.enabled must be true, false or "auto"'),
        ({"enabled": True, "loss_scale": -1}, {}, r"fp16.loss_scale must be a finite number >= 0"),
        ({"enabled": True, "loss_scale": True}, {}, r"fp16.loss_scale must be a finite number"),
        ({"enabled": True, "loss_scale": "auto"}, {}, r"fp16.loss_scale is 'auto'"),
        ({"enabled": True, "loss_scale_window": 0}, {}, r"fp16.loss_scale_window must be an integer >= 1"),
        ({"enabled": True, "min_loss_scale": 0}, {}, r"fp16.min_loss_scale must be an integer >= 1"),
        ({"enabled": True, "hysteresis": 0}, {}, r"fp16.hysteresis must be an integer >= 1"),
        ({"enabled": True, "initial_scale_power": 1.5}, {}, r"fp16.initial_scale_power must be an integer"),
        ({"enabled": True, "consecutive_hysteresis": 1}, {}, r"fp16.consecutive_hysteresis must be true or false"),
        ({"enabled": True, "auto_cast": True}, {}, r"fp16.auto_cast must be false"),
        ({"enabled": True, "loss_scael": 0}, {}, r"unknown fp16 key\(s\) loss_scael; valid: enabled"),
        ({"enabled": True}, {"megatrain": {"non_finite_steps": "raise"}}, r'non_finite_steps "raise" cannot go'),
        ({"enabled": True}, {"megatrain": {"optimizer_device": "gpu"}}, r'optimizer_device "gpu" does not'),
        ({"enabled": True}, {"megatrain": {"master_dtype": "bf16"}}, r'master_dtype must be "fp32" with fp16'),
    ],
)
def test_bad_fp16_blocks_name_the_key(fp16, top, message):
    with pytest.raises(ConfigError, match=message):
        _parse(fp16, **top)
