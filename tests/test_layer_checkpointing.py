"""The model's own activation checkpointing inside streamed blocks ([Note: layer checkpointing]).

Hugging Face's ``gradient_checkpointing_enable`` (what ``TrainingArguments(gradient_checkpointing=True)``
and TRL's ``SFTConfig`` default call) and a user's ``torch.utils.checkpoint`` around a block
must train exactly as without them: the same losses and weights, bit for bit, as the engine
without checkpointing (same kernels, same inputs, same dropout masks), and parity with plain
PyTorch within the tolerances of ``test_parity.py``. Modules outside the blocks keep theirs.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import tiny_models
import torch
import transformers
from side_by_side import ds_config, train_side_by_side
from test_parity import assert_parity
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatrain_ds import MegatrainEngine, parse_engine_config

pytestmark = pytest.mark.usefixtures("cpu_single_thread")
STEPS = 3


def _has_every_n_layers() -> bool:
    """Whether ``gradient_checkpointing_enable`` takes ``every_n_layers`` (a transformers 5
    release added it: 5.16.0 has it, 5.10.1 not, 5.2.0, the lowest supported, not)."""
    try:
        tiny_models.FAMILIES["qwen2"]().gradient_checkpointing_enable(every_n_layers=2)
    except TypeError:
        return False
    return True


def _with_hf_checkpointing(family: str, **kwargs) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = tiny_models.FAMILIES[family]()
        model.gradient_checkpointing_enable(**kwargs)
        return model

    return make


def _train(make_model: Callable[[], nn.Module], config: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine, _, trace = train_side_by_side(make_model, config, steps=STEPS)
    try:
        return trace.engine_losses, {k: v.clone() for k, v in engine.module.state_dict().items()}
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        ("llama", {}),  # transformers' default: use_reentrant=False
        ("llama", {"gradient_checkpointing_kwargs": {"use_reentrant": True}}),
        ("gpt2", {}),  # dropout on: the recompute must replay the forward's masks
        ("qwen2", {"every_n_layers": 2}),  # the flag differs between blocks of one template
    ],
)
def test_hf_gradient_checkpointing_trains_as_without_it(family, kwargs, caplog) -> None:
    if "every_n_layers" in kwargs and not _has_every_n_layers():
        pytest.skip(f"transformers {transformers.__version__}'s gradient_checkpointing_enable has no every_n_layers")
    config = ds_config(megatrain={"checkpoint_interval": 2})
    plain_losses, plain_weights = _train(tiny_models.FAMILIES[family], config)
    with caplog.at_level(logging.INFO, logger="megatrain_ds.model.layer_checkpointing"):
        engine, reference, trace = train_side_by_side(_with_hf_checkpointing(family, **kwargs), config, steps=STEPS)
    try:
        # The user's model still says what the user asked; only the templates ignore it (what
        # transformers' is_activation_checkpointing, is_gradient_checkpointing before 5.2x, reads).
        assert any(getattr(module, "gradient_checkpointing", False) for module in engine.module.modules())
        assert trace.engine_losses == plain_losses
        weights = engine.module.state_dict()
        assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)
        # The reference trained the same model with HF's checkpointing in plain PyTorch.
        assert_parity(engine, reference, trace)
        notes = [r.getMessage() for r in caplog.records if "gradient checkpointing is skipped" in r.getMessage()]
        assert len(notes) == 1, notes
    finally:
        engine.destroy()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(torch.tanh(self.up(hidden)))


class _Head(nn.Linear):
    calls = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(hidden)


class _UserCheckpointed(nn.Module):
    """A hand-written model that wraps blocks (and, optionally, its head) in ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool | None, checkpoint_head: bool = False) -> None:
        super().__init__()
        self.reentrant, self.checkpoint_head = reentrant, checkpoint_head
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.head = _Head(16, 50)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = (
                layer(hidden) if self.reentrant is None else checkpoint(layer, hidden, use_reentrant=self.reentrant)
            )
        logits = checkpoint(self.head, hidden, use_reentrant=False) if self.checkpoint_head else self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _train_user_model(model: nn.Module) -> tuple[list[float], MegatrainEngine, nn.Module]:
    """``STEPS`` steps on the engine and on a plain-PyTorch deep copy, the same batches."""
    reference = copy.deepcopy(model)
    engine = MegatrainEngine(model, parse_engine_config(ds_config(clipping=0.0)))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        reference(input_ids=ids, labels=ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses, engine, reference


@pytest.mark.parametrize("reentrant", [False, True])
def test_user_checkpoint_around_a_block_trains_as_without_it(reentrant, caplog) -> None:
    torch.manual_seed(0)
    plain_losses, plain, _ = _train_user_model(_UserCheckpointed(reentrant=None))
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="megatrain_ds.model.layer_checkpointing"):
        losses, engine, reference = _train_user_model(_UserCheckpointed(reentrant=reentrant))
    try:
        assert losses == plain_losses
        ours, theirs, without = engine.module.state_dict(), reference.state_dict(), plain.module.state_dict()
        for name in theirs:
            assert torch.equal(ours[name], without[name]), name
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)
        # Reentrant: the block runs again inside backward (one more weight pass), said once.
        warnings = [r for r in caplog.records if "ran again inside backward" in r.getMessage()]
        assert len(warnings) == (1 if reentrant else 0)
    finally:
        engine.destroy()
        plain.destroy()


def test_checkpointing_outside_the_blocks_is_kept() -> None:
    """A checkpointed head (not a block) still recomputes in backward: two calls per step."""
    torch.manual_seed(0)
    _Head.calls = 0
    _, engine, reference = _train_user_model(_UserCheckpointed(reentrant=False, checkpoint_head=True))
    try:
        assert _Head.calls == 2 * STEPS * 2  # engine and reference: forward + recompute, each step
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(engine.module.state_dict()[name], value, rtol=1e-5, atol=1e-7)
    finally:
        engine.destroy()
