"""One answer from ``state_dict``: every way of taking the weights gives the masters, wherever they are.

Single process, for each placement the engine has there -- the state in host memory (RAM),
the optimizer state and the fp32 masters on the NVMe tier (``"nvme_offload": "optimizer"``,
where the parameters view the compute-dtype shadow), the weights on the tier too
(``"all"``, where the parameters are meta tensors) -- with fp16 and with bf16 compute:
``engine.module.state_dict()``, the engine's own ``state_dict()``,
``_zero3_consolidated_16bit_state_dict()`` (what Accelerate's ``get_state_dict`` and the HF
Trainer's ``save_model`` take under a ZeRO-3 config), the file ``save_16bit_model`` writes
and the model directory ``save_pretrained`` writes must all hold the RAM run's fp32 masters.

Bit-equality is the right bar, not a tolerance: the tier only moves bytes (``tests/test_nvme_tier.py``),
the optimizer runs the same AdamW on the same values in every placement, and forward and
backward read the same compute-dtype weights (the shadow, or the master rounded as it is
read from the tier: the same rounding). The RAM run's masters are checked against plain
PyTorch elsewhere (``tests/test_fp16.py``, ``tests/test_bf16.py``); here every placement
is checked against it, and the RAM run's state dict against its masters read directly.
The two collective placements (data parallel) are ``tests/test_state_dict_collectives.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import tiny_models
import torch
from side_by_side import ds_config

from megatrain_ds.integration.deepspeed_adapter import MegatrainDeepSpeedEngine

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

PLACEMENTS = ("ram", "optimizer", "all")
STEPS = 2


def _trained(placement: str, compute: str, swap: Path) -> tuple[MegatrainDeepSpeedEngine, list[float]]:
    """``STEPS`` optimizer steps of a tiny Llama through ``deepspeed.initialize``, as a
    DeepSpeed script trains it; the same model, batches and hyperparameters every time."""
    import deepspeed

    options = {"nvme_offload": placement, "nvme_path": str(swap), "nvme_window_blocks": 2} if placement != "ram" else {}
    config = ds_config(megatrain=options, bf16=compute == "bf16")
    if compute == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=tiny_models.llama(), config=config)
    assert isinstance(engine, MegatrainDeepSpeedEngine)
    losses = []
    for step in range(STEPS):
        loss = engine(**tiny_models.make_batch(step)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def _every_answer(engine: MegatrainDeepSpeedEngine, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The weights as each entry point gives them."""
    engine.save_16bit_model(out, "model.bin")
    engine.module.save_pretrained(out / "pretrained")
    pretrained = safetensors.torch.load_file(out / "pretrained" / "model.safetensors")
    return {
        "module.state_dict": engine.module.state_dict(),
        "engine.state_dict": {k.removeprefix("module."): v for k, v in engine.state_dict().items()},
        "_zero3_consolidated_16bit_state_dict": engine._zero3_consolidated_16bit_state_dict(),
        "save_16bit_model": torch.load(out / "model.bin", weights_only=True),
        "save_pretrained": pretrained,
    }


@pytest.mark.parametrize("compute", ["fp16", "bf16"])
def test_every_placement_gives_the_ram_runs_fp32_masters(tmp_path: Path, compute: str) -> None:
    expected: dict[str, torch.Tensor] = {}
    expected_losses: list[float] = []
    for placement in PLACEMENTS:
        engine, losses = _trained(placement, compute, tmp_path / "swap" / placement)
        try:
            answers = _every_answer(engine, tmp_path / placement)
            if placement == "ram":  # the reference: the live fp32 masters, read directly
                expected_losses = losses
                expected = {k: v.clone() for k, v in answers["module.state_dict"].items()}
                masters = {id(p): state.weight_view(i) for state in engine.states for i, p in enumerate(state.params)}
                for name, param in engine.module.named_parameters():
                    assert torch.equal(expected[name], masters[id(param)]), name
                assert all(value.dtype == torch.float32 for value in expected.values())
            else:
                # The parameters are not the masters here: their values are the compute copies, or none.
                assert all(p.dtype != torch.float32 or p.is_meta for p in engine.module.model.layers[0].parameters())
        finally:
            engine.destroy()
        assert losses == expected_losses, placement
        for source, state in answers.items():
            assert state.keys() == expected.keys(), (placement, source)
            for key, value in expected.items():
                ours = state[key]
                assert ours.dtype == value.dtype and torch.equal(ours, value), (placement, source, key)
