"""The optimizer object ``deepspeed.initialize`` returns, and its parameter groups.

Its ``param_groups`` (``lr``, ``betas``, ``eps``, ``weight_decay`` per group) are what the
host AdamW reads at every update, so a learning-rate scheduler attached to it, or to a
client optimizer whose groups it shares, takes effect as it would with DeepSpeed.

[Note: the client optimizer's step]
With a client optimizer (what Accelerate and the HF Trainer pass), DeepSpeed's
``engine.step()`` calls the client's own ``step``. Code attached to that object expects it:
a ``torch.optim.lr_scheduler`` built on the client before ``deepspeed.initialize`` (the
usual Accelerate script) warns "lr_scheduler.step() before optimizer.step()" unless the
client's ``step`` ran, and step hooks registered on it would never fire. So
``MegatrainOptimizer.step`` finishes the engine's update and then calls the client's
``step``, which finds no ``.grad`` on any parameter (the engine keeps gradients in host
buffers and clears the few that autograd leaves on resident parameters as soon as they are
copied out) and therefore changes no weight and no state: it only does the bookkeeping of
a step. The engine's update reads the hyperparameters from the shared groups.

[Note: evaluation-only engines]
DeepSpeed builds an engine without an optimizer when ``deepspeed.initialize`` gets neither
``optimizer=`` nor an ``"optimizer"`` block: it runs forward passes (ZeRO inference) and
asserts at ``backward()`` and ``step()``. The HF Trainer does that when ``evaluate()`` or
``predict()`` runs before ``train()`` (its ``deepspeed_init(inference=True)`` drops the
config's ``"optimizer"`` block: ``integration/deepspeed_hook.py``, [Note: evaluation before
training]). So :func:`build_optimizer` given no optimizer, no block and no
``model_parameters`` builds :meth:`MegatrainOptimizer.for_evaluation`: one group with no
parameter in it, so every parameter is held as a frozen one (its weights alone, no moment
and no gradient; in its own dtype, or as ``"frozen_weights"`` says under bf16 or fp16
compute: ``state/placement.py``) and the model's ``requires_grad`` flags are left as they
are. The engine refuses ``backward()`` and ``step()`` on it with the way out, and
``deepspeed.initialize`` returns no optimizer and no scheduler for it (DeepSpeed's returns
``None`` at stage 0 without bf16, else an object built on no optimizer: at ZeRO-3 its
parameter offload; read in DeepSpeed 0.19.8's ``DeepSpeedEngine.__init__``). Given
``model_parameters`` without an optimizer the call means to train, and stays an error.

Every placement builds it as it builds a training engine of frozen weights
(``tests/test_evaluation_only.py``): with data parallel every rank evaluates its own batch on
the first node's weights, and the entry points that take the weights are the same
collectives (with several nodes each holds every weight whole: there is no trained master
to shard); ``"nvme_offload": "all"`` keeps the blocks' weights on the tier (in read-only
files of frozen weights; the swap files of optimizer state are empty); ``"optimizer"`` has
no optimizer state to hold, so it opens no tier (``planning/preflight.py``:
``_optimizer_tier_or_none``). With bf16 or fp16 compute the forward runs in that dtype, as
DeepSpeed's ZeRO-3 evaluates (it casts the module), while each fp32 weight stays exact
beside its streamed copy (6 B/param under the default ``"frozen_weights": "exact"``;
``"compute_dtype"`` casts it once, 2 B/param, as DeepSpeed holds it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from megatrain_ds.config import ConfigError, OptimizerSpec
from megatrain_ds.optimizer.loss_scaling import LossScaling
from megatrain_ds.state.flat_layout import FROZEN_GROUP

_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
# DeepSpeed's Adam implementations, which Accelerate substitutes for a client torch
# optimizer when the config offloads the optimizer (accelerate's map_pytorch_optim_to_deepspeed).
_DEEPSPEED_ADAM_CLASSES = ("DeepSpeedCPUAdam", "FusedAdam")


class MegatrainOptimizer(torch.optim.Optimizer):
    """Parameter groups of the engine's host AdamW.

    As with DeepSpeed, ``engine.step()`` calls ``step()`` at the accumulation boundary;
    that finishes the update the engine's gradient worker started (so schedulers that
    watch ``step`` see it). Gradients live in the engine's host buffers, which each update
    clears, so ``zero_grad`` has nothing to clear.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        defaults: dict[str, Any],
        decoupled: bool,
        client: torch.optim.Optimizer | None = None,
        evaluation_only: bool = False,
    ) -> None:
        super().__init__(param_groups, defaults)
        self.decoupled = decoupled
        self.client = client
        """The optimizer passed to ``deepspeed.initialize``, whose groups these are."""
        self.evaluation_only = evaluation_only
        """Built without any optimizer: it trains nothing ([Note: evaluation-only engines])."""
        self._finish_update: Callable[[], None] | None = None
        self.overflow = False
        """Whether the last step was skipped for non-finite gradients (an fp16 overflow among
        them): DeepSpeed's attribute, which Accelerate's ``step_was_skipped`` reads."""
        self.loss_scaling: LossScaling | None = None
        """The engine's loss scaling (set by the engine; DeepSpeed's scaler inside)."""

    @classmethod
    def for_evaluation(cls) -> MegatrainOptimizer:
        """The optimizer of an engine built without one: no parameter in its one group, so
        the engine holds every parameter frozen ([Note: evaluation-only engines])."""
        return cls([{"params": []}], {}, decoupled=True, evaluation_only=True)

    def refuse_if_evaluation_only(self, call: str) -> None:
        """The engine's ``call`` (``backward``, ``step``) refused on an engine built without an
        optimizer, as DeepSpeed refuses it ([Note: evaluation-only engines])."""
        if self.evaluation_only:
            raise RuntimeError(
                f"{call}() needs an optimizer: this engine was built without one, for evaluation only "
                '(no optimizer=, model_parameters= or "optimizer" block; the HF Trainer builds it so '
                "when evaluate() or predict() runs before train()). Build the engine with an optimizer "
                "to train: call trainer.train() before evaluating, or give the model to a new Trainer"
            )

    def attach(self, finish_update: Callable[[], None]) -> None:
        """Called once by the engine: what ``step()`` runs."""
        self._finish_update = finish_update

    # DeepSpeed's fp16 optimizers promote these so that scripts can read and set the scale.
    @property
    def loss_scaler(self) -> Any:
        """DeepSpeed's loss scaler (``DynamicLossScaler`` or ``LossScaler``), or ``None``."""
        return self.loss_scaling.scaler if self.loss_scaling is not None else None

    @property
    def loss_scale(self) -> float:
        """The current loss scale: 1.0 without fp16."""
        return self.loss_scaling.scale if self.loss_scaling is not None else 1.0

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        if self.loss_scaling is None:
            raise RuntimeError("this optimizer belongs to no megatrain engine")
        self.loss_scaling.scaler.cur_scale = value

    cur_scale = loss_scale

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("closures are not supported: the engine computes the gradients")
        if self._finish_update is None:
            raise RuntimeError("this optimizer belongs to no megatrain engine")
        self._finish_update()
        if self.client is not None:
            self.client.step()  # a no-op on the weights: see [Note: the client optimizer's step]

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none


def _groups_from(model: nn.Module, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and all(isinstance(item, dict) for item in items):
        return [dict(group, params=list(group["params"])) for group in items]
    if all(isinstance(item, torch.Tensor) for item in items):
        return [{"params": items}]
    raise ConfigError("model_parameters must be parameters or parameter-group dicts")


def build_optimizer(
    model: nn.Module,
    model_parameters: Iterable[Any] | None,
    spec: OptimizerSpec | None,
    client: torch.optim.Optimizer | None,
) -> MegatrainOptimizer:
    """The engine's optimizer from the config's ``optimizer`` block or a client optimizer,
    or, given neither nor ``model_parameters``, one that trains nothing
    ([Note: evaluation-only engines]).

    A client ``torch.optim.AdamW``/``Adam`` contributes its groups (the same dicts, so
    its scheduler keeps working) and hyperparameters; any other class is an error.
    """
    if client is not None:
        decoupled = _client_decoupled(client)
        for group in client.param_groups:
            if group.get("amsgrad") or group.get("maximize") or not group.get("bias_correction", True):
                raise ConfigError("client optimizer options amsgrad/maximize/bias_correction=False are not supported")
        facade = MegatrainOptimizer([{"params": []}], dict(client.defaults), decoupled, client)
        facade.param_groups = client.param_groups  # shared: the client's scheduler drives us
        return facade
    if spec is None:
        if model_parameters is None:  # no optimizer asked for at all: DeepSpeed's inference engine
            return MegatrainOptimizer.for_evaluation()  # [Note: evaluation-only engines]
        raise ConfigError(
            'no optimizer: add an "optimizer" block (type AdamW) to the config or pass '
            "optimizer=torch.optim.AdamW(...) to deepspeed.initialize"
        )
    defaults = {"lr": spec.lr, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}
    groups = [{**defaults, **group} for group in _groups_from(model, model_parameters)]
    return MegatrainOptimizer(groups, defaults, spec.decoupled)


def _client_decoupled(client: torch.optim.Optimizer) -> bool:
    """Whether a supported client optimizer decays weights AdamW-style; else ConfigError."""
    kind = type(client)
    if isinstance(client, torch.optim.AdamW):
        return True
    if kind is torch.optim.Adam:
        return bool(client.defaults.get("decoupled_weight_decay", False))
    if kind.__name__ in _DEEPSPEED_ADAM_CLASSES and kind.__module__.startswith("deepspeed."):
        return bool(getattr(client, "adam_w_mode", True))
    raise ConfigError(
        f"client optimizer {kind.__name__} is not supported; pass torch.optim.AdamW or "
        'torch.optim.Adam (or DeepSpeed\'s Adam), or use an "optimizer" block of type AdamW'
    )


def group_index_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, int]:
    """Map each model parameter to its optimizer group; untrained ones to ``FROZEN_GROUP``."""
    index: dict[nn.Parameter, int] = {}
    for number, group in enumerate(optimizer.param_groups):
        missing = [key for key in _HYPERPARAMETERS if key not in group]
        if missing and group["params"]:  # a group with no parameter trains nothing
            raise ConfigError(f"optimizer group {number} lacks {', '.join(missing)}")
        for param in group["params"]:
            if param in index:
                raise ConfigError("a parameter appears in more than one optimizer group")
            index[param] = number
    return {p: (index.get(p, FROZEN_GROUP) if p.requires_grad else FROZEN_GROUP) for p in model.parameters()}
