"""deepspeed.initialize routes "engine": "megatrain" configs here and leaves others alone."""

import json
import subprocess
import sys
import textwrap

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
