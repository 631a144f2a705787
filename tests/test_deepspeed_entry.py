"""deepspeed.initialize routes "engine": "megatrain" configs here and leaves others alone."""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import tiny_models
import torch
from side_by_side import ds_config


def test_megatrain_config_is_routed_to_the_engine(tmp_path):
    import deepspeed

    import megatrain_ds

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config()))
    for config in (ds_config(), str(path)):
        engine, optimizer, loader, scheduler = deepspeed.initialize(
            model=tiny_models.llama(), config=config, training_data=list(range(10))
        )
        try:
            assert isinstance(engine, megatrain_ds.MegatrainEngine)
            assert optimizer is engine.optimizer and scheduler is None
            assert next(iter(loader)).shape == (2,)
            loss = engine(**tiny_models.make_batch(0)).loss
            engine.backward(loss)
            engine.step()
            assert engine.global_steps == 1
        finally:
            engine.destroy()


def test_other_configs_reach_deepspeed_unchanged():
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    import megatrain_ds  # noqa: F401  (installs the routing)

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=tiny_models.llama(), config=config, model_parameters=None)
    assert type(engine) is DeepSpeedEngine


def test_routing_works_whichever_is_imported_first():
    for imports in ("import deepspeed, megatrain_ds", "import megatrain_ds, deepspeed"):
        script = textwrap.dedent(f"""
            {imports}
            print(getattr(deepspeed.initialize, "__megatrain_original__", None) is not None)
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        assert result.stdout.strip().splitlines()[-1] == "True", result.stderr


def test_routing_can_be_switched_off(monkeypatch):
    import deepspeed

    import megatrain_ds

    monkeypatch.setenv("MEGATRAIN_DISABLE_HOOK", "1")
    config = ds_config()
    del config["megatrain"]  # DeepSpeed rejects no keys, but must be the one that runs
    config["optimizer"]["params"]["torch_adam"] = True
    engine, *_ = deepspeed.initialize(model=tiny_models.llama(), config=config)
    assert not isinstance(engine, megatrain_ds.MegatrainEngine)
    assert isinstance(engine.module, torch.nn.Module)


def _accelerate_says_deepspeed(monkeypatch) -> None:
    """Accelerate's state as ``TrainingArguments(deepspeed=...)`` leaves it in a script run as
    plain ``python`` (seen with transformers 5.23.0 and Accelerate 1.15.0):
    ``DistributedType.DEEPSPEED``; restored when the test ends."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    monkeypatch.setitem(PartialState._shared_state, "distributed_type", DistributedType.DEEPSPEED)


def test_a_deepspeed_run_without_a_launcher_is_warned_before_it_trains(monkeypatch):
    """Without a process group the Trainer would stop at its first logging step; the warning,
    naming the launch that works, comes from ``deepspeed.initialize``."""
    import deepspeed

    import megatrain_ds  # noqa: F401  (installs the routing)

    _accelerate_says_deepspeed(monkeypatch)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # whatever this worker joined
    with pytest.warns(UserWarning, match="torchrun --nproc_per_node 1"):
        engine, *_ = deepspeed.initialize(model=tiny_models.llama(), config=ds_config())
    engine.destroy()


def test_no_warning_with_a_process_group_or_without_accelerates_deepspeed(monkeypatch):
    """A launched run has its group (a real one here, of one rank), and a script that is not
    under Accelerate's DeepSpeed state gathers nothing through it: neither is warned."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from megatrain_ds.integration.initialize import warn_if_unlaunched_under_accelerate

    _accelerate_says_deepspeed(monkeypatch)
    made_here = not torch.distributed.is_initialized()
    if made_here:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warn_if_unlaunched_under_accelerate()
    finally:
        if made_here:
            torch.distributed.destroy_process_group()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setitem(PartialState._shared_state, "distributed_type", DistributedType.NO)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_unlaunched_under_accelerate()
