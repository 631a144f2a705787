"""Schedulers and client optimizers through ``deepspeed.initialize``, against plain PyTorch.

The reference is the model before the engine took it (deep copy), trained with
``torch.optim.AdamW`` and ``clip_grad_norm_`` and driven by the same scheduler class
(DeepSpeed's own, from ``deepspeed.runtime.lr_schedules``, or torch's). fp32 on both
sides: learning rates must agree exactly, weights to 2e-7 relative (tests/side_by_side.py).
"""

import copy
import warnings

import pytest
import tiny_models
import torch
from side_by_side import relative_weight_error

from megatrain_ds import ConfigError

LR, WEIGHT_DECAY, STEPS = 1e-3, 0.1, 6


def _config(**extra):
    return {"engine": "megatrain", "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, **extra}


def _train(engine, reference, reference_optimizer, reference_scheduler, user_scheduler=None):
    """Step both STEPS times; returns the learning rates each used, step by step."""
    lrs, reference_lrs = [], []
    for step in range(STEPS):
        batch = tiny_models.make_batch(step)
        lrs.append(engine.get_lr())
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        if user_scheduler is not None:  # a scheduler the script steps itself (Accelerate's way)
            user_scheduler.step()
        reference_lrs.append([group["lr"] for group in reference_optimizer.param_groups])
        reference(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        reference_optimizer.step()
        reference_scheduler.step()
        reference_optimizer.zero_grad()
    return lrs, reference_lrs


SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "linear"},
    "WarmupDecayLR": {"warmup_min_lr": 1e-4, "warmup_max_lr": LR, "warmup_num_steps": 2, "total_num_steps": STEPS},
    "WarmupCosineLR": {"total_num_steps": STEPS, "warmup_num_steps": 2, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.2},
    "StepLR": {"step_size": 2, "gamma": 0.5},  # any torch.optim.lr_scheduler class, as DeepSpeed allows
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_config_scheduler_has_deepspeeds_semantics(name):
    import deepspeed
    from deepspeed.runtime import lr_schedules

    params = SCHEDULERS[name]
    torch.manual_seed(0)
    model = tiny_models.llama()
    reference = copy.deepcopy(model)
    config = _config(
        optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        scheduler={"type": name, "params": params},
    )
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=config)
    try:
        scheduler_class = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name)
        assert type(scheduler) is scheduler_class and engine.lr_scheduler is scheduler
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        reference_scheduler = scheduler_class(reference_optimizer, **params)
        lrs, reference_lrs = _train(engine, reference, reference_optimizer, reference_scheduler)
        assert lrs == reference_lrs
        assert len(set(lr[0] for lr in lrs)) > 1  # the schedule did move the learning rate
        assert relative_weight_error(engine, reference) < 2e-7
    finally:
        engine.destroy()


def test_client_optimizer_groups_and_scheduler_are_honoured():
    """As Accelerate passes them: a client AdamW with no weight decay on norms, and a
    LambdaLR built on it before deepspeed.initialize, stepped by the script. The engine
    reads each group's weight decay and every learning rate the scheduler sets; the
    scheduler sees an optimizer step (no order warning); the client's own step touches
    no parameter (it has no state)."""
    import deepspeed

    torch.manual_seed(0)
    model = tiny_models.llama()
    reference = copy.deepcopy(model)

    def groups(m):
        return [
            {"params": [p for n, p in m.named_parameters() if "norm" not in n], "weight_decay": WEIGHT_DECAY},
            {"params": [p for n, p in m.named_parameters() if "norm" in n], "weight_decay": 0.0},
        ]

    def schedule(step):
        return [0.5, 1.0, 0.25, 0.1, 1.0, 0.5][step % STEPS]

    client = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.95))
    client_scheduler = torch.optim.lr_scheduler.LambdaLR(client, schedule)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=client, config=_config())
    try:
        assert scheduler is None and optimizer.param_groups is client.param_groups
        reference_optimizer = torch.optim.AdamW(groups(reference), lr=LR, betas=(0.9, 0.95))
        reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference_optimizer, schedule)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lrs, reference_lrs = _train(
                engine, reference, reference_optimizer, reference_scheduler, user_scheduler=client_scheduler
            )
        assert [str(w.message) for w in caught if "lr_scheduler" in str(w.message)] == []
        assert lrs == reference_lrs
        assert relative_weight_error(engine, reference) < 2e-7
        assert len(client.state) == 0
    finally:
        engine.destroy()


def test_client_scheduler_wins_over_the_config_block():
    """DeepSpeed's precedence: lr_scheduler= (here its callable form) over "scheduler"."""
    import deepspeed

    config = _config(
        optimizer={"type": "AdamW", "params": {"lr": LR}},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
    )
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=tiny_models.llama(),
        config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5),
    )
    try:
        assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and scheduler.optimizer is optimizer
        assert engine.lr_scheduler is scheduler and engine.get_lr() == [LR * 0.5]
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "scheduler, message",
    [
        (
            {"type": "WarmupLinear"},
            r"scheduler.type 'WarmupLinear' is not a DeepSpeed or torch scheduler; "
            r"DeepSpeed's: .*WarmupDecayLR",
        ),
        ({"type": "Optimizer"}, r"scheduler.type 'Optimizer' is not a DeepSpeed or torch scheduler"),
        ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, r"scheduler.params do not fit WarmupLR"),
    ],
)
def test_bad_scheduler_blocks_are_rejected(scheduler, message):
    import deepspeed

    config = _config(optimizer={"type": "AdamW", "params": {"lr": LR}}, scheduler=scheduler)
    with pytest.raises(ConfigError, match=message):
        deepspeed.initialize(model=tiny_models.llama(num_layers=2), config=config)


def test_unsupported_client_optimizer_is_named():
    import deepspeed

    model = tiny_models.llama(num_layers=2)
    with pytest.raises(ConfigError, match=r"client optimizer SGD is not supported; pass torch.optim.AdamW"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_config())


def test_deepspeeds_adam_as_client_follows_its_adam_w_mode():
    """Accelerate swaps a client AdamW for DeepSpeedCPUAdam when the config offloads the
    optimizer; the engine takes its groups and its adam_w_mode (a stand-in class with the
    same name and module: the real one compiles a C++ op when constructed)."""
    from megatrain_ds.optimizer.facade import build_optimizer

    stand_in = type("DeepSpeedCPUAdam", (torch.optim.Optimizer,), {"__module__": "deepspeed.ops.adam.cpu_adam"})
    model = tiny_models.llama(num_layers=2)
    for adam_w_mode in (True, False):
        client = stand_in(
            model.parameters(),
            {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True},
        )
        client.adam_w_mode = adam_w_mode
        facade = build_optimizer(model, None, None, client)
        assert facade.decoupled is adam_w_mode and facade.param_groups is client.param_groups
