"""Every DeepSpeed config key accounted for, and the keys honoured as DeepSpeed's engine does.

The list of DeepSpeed's keys is DeepSpeed's own: the top-level keys its config parser
(``DeepSpeedConfig``) reads, recorded while it parses, and the fields of its ZeRO config
model. docs/configuration.md's tables must name each, and
``megatrain_ds/config/deepspeed_keys.py`` must do what they say. The honoured keys are
compared with DeepSpeed's engine on the same model, config and batches (stage 0, fp32,
CPU; ``MEGATRAIN_DISABLE_HOOK=1``).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import sys
from collections.abc import KeysView
from pathlib import Path
from typing import Any

import fork_server
import pytest
import tiny_models
import torch
from side_by_side import ds_config

from megatrain_ds import ConfigError, parse_engine_config
from megatrain_ds.config import deepspeed_keys as config_module

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BASE = {"train_micro_batch_size_per_gpu": 1}

# A value of each "error" key that asks for what the engine refuses.
REFUSING = {
    "tensor_parallel": {"autotp_size": 2},
    "sequence_parallel_size": 2,
    "expert_parallel": {"enabled": True},
    "torch_autocast": {"enabled": True},
    "managed_gradient_accumulation": False,
    "gradient_allreduce_op": "sum",
}
NOT_READ_BY_DEEPSPEEDS_PARSER = {"sequence_parallel_size"}
"""Read by ``DeepSpeedConfig`` only with a process group (it divides the world size by it): in
the table whether or not this process has one."""


def _table(heading: str) -> dict[str, str]:
    """``key -> classification`` of the table under ``heading`` in docs/configuration.md."""
    lines = DOC.read_text(encoding="utf-8").split(heading + "\n", 1)[1].splitlines()
    rows = [line for line in lines[next(i for i, line in enumerate(lines) if line.startswith("|")) :]]
    table: dict[str, str] = {}
    for row in rows[2:]:
        if not row.startswith("|"):
            break
        keys, here = (cell.strip() for cell in row.strip("|").split("|")[:2])
        assert here in ("honoured", "mapped", "warned", "error"), row
        for key in re.findall(r"`([^`]+)`", keys):
            assert key not in table, f"{key} twice in the table"
            table[key] = here
    return table


class _KeysSeen(KeysView):
    def __init__(self, mapping: _Recording) -> None:
        super().__init__(mapping)
        self._seen = mapping.seen

    def __contains__(self, key: object) -> bool:
        self._seen.add(key)
        return dict.__contains__(self._mapping, key)  # type: ignore[arg-type]


class _Recording(dict):
    """A config dict that records every key looked up in it (``get``, ``[]``, ``in``, ``keys()``)."""

    def __init__(self, data: dict[str, Any], seen: set[object]) -> None:
        super().__init__(data)
        self.seen = seen

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self) -> _KeysSeen:  # type: ignore[override]
        return _KeysSeen(self)

    def __copy__(self) -> _Recording:
        return _Recording(dict(self), self.seen)


def deepspeed_top_level_keys() -> set[str]:
    """The top-level keys DeepSpeed's config parser reads (its sub-configs included)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    seen: set[object] = set()
    DeepSpeedConfig(_Recording(dict(BASE), seen))
    return {key for key in seen if isinstance(key, str)}


def test_every_deepspeed_key_is_in_the_table():
    keys = deepspeed_top_level_keys()
    assert len(keys) > 50 and {"optimizer", "zero_optimization", "csv_monitor", "flops_profiler"} <= keys
    table = _table("## Every DeepSpeed key")
    assert sorted(keys - table.keys()) == []
    # Read or not by this parse depending on whether an earlier test left a process group.
    assert table.keys() - keys <= NOT_READ_BY_DEEPSPEEDS_PARSER


def test_the_table_says_what_the_parser_does(caplog):
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS

    table = _table("## Every DeepSpeed key")
    kinds = {kind: {key for key, here in table.items() if here == kind} for kind in set(table.values())}
    known = config_module._KNOWN_TOP_LEVEL
    assert kinds["honoured"] | kinds["mapped"] <= known
    assert kinds["warned"] == set(config_module._IGNORED_TOP_LEVEL)
    assert kinds["error"] == set(config_module._REMOVED_FROM_DEEPSPEED) | set(REFUSING)
    assert set(_REMOVED_TOP_LEVEL_CONFIG_KEYS) == set(config_module._REMOVED_FROM_DEEPSPEED)
    for key in sorted(kinds["warned"]):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert parse_engine_config({**BASE, key: {}}).ignored_keys == (key,)
        assert f"{key} ({config_module._IGNORED_TOP_LEVEL[key]})" in caplog.text
    for key in sorted(kinds["error"]):
        with pytest.raises(ConfigError, match=re.escape(key)):
            parse_engine_config({**BASE, key: REFUSING.get(key, {})})
    for key, value in {"tensor_parallel": {"autotp_size": 0}, "managed_gradient_accumulation": True}.items():
        assert parse_engine_config({**BASE, key: value}).ignored_keys == ()  # DeepSpeed's defaults: no fuss


def test_every_zero_optimization_key_is_in_the_table():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = {field.alias or name: field for name, field in DeepSpeedZeroConfig.model_fields.items()}
    table = _table("### `zero_optimization` keys")
    assert sorted(fields.keys() - table.keys()) == [] and sorted(table.keys() - fields.keys()) == []
    for key, here in table.items():
        if key.startswith("offload_"):
            continue  # their sub-keys: tests/test_deepspeed_config.py
        default = fields[key].default
        value = default if isinstance(default, (bool, int, float, str)) else 1
        ignored = parse_engine_config({**BASE, "zero_optimization": {"stage": 0, key: value}}).ignored_keys
        assert ignored == ((f"zero_optimization.{key}",) if here == "warned" else ()), key


# -- monitors, steps_per_print and wall_clock_breakdown next to DeepSpeed's engine ---------------


def _reference_config(config: dict[str, Any]) -> dict[str, Any]:
    """The same config for DeepSpeed itself: no engine keys, its torch AdamW (as ours: torch's arithmetic)."""
    config = {k: v for k, v in config.items() if k not in ("engine", "megatrain")}
    config["optimizer"] = {**config["optimizer"], "params": {**config["optimizer"]["params"], "torch_adam": True}}
    return config


def _train(engine: Any, steps: int, accumulation: int) -> list[float]:
    losses = []
    for micro in range(steps * accumulation):
        loss = engine(**tiny_models.make_batch(micro)).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _run(monkeypatch, capsys, caplog, config: dict[str, Any], *, reference: bool, accumulation: int):
    import deepspeed
    from deepspeed.utils import logger

    monkeypatch.setenv("MEGATRAIN_DISABLE_HOOK", "1" if reference else "0")
    torch.manual_seed(0)
    model = tiny_models.llama()
    engine, *_ = deepspeed.initialize(model=model, config=_reference_config(config) if reference else config)
    logger.addHandler(caplog.handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # DeepSpeed's progress lines are INFO; its default is WARNING
    try:
        caplog.clear()
        capsys.readouterr()
        losses = _train(engine, steps=4, accumulation=accumulation)
        printed = capsys.readouterr().out
        logged = "\n".join(caplog.messages)
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
        engine.destroy()
    return losses, printed, logged


def _csv_files(directory: Path) -> dict[str, list[list[str]]]:
    return {path.name: list(csv.reader(path.open())) for path in sorted(directory.glob("*.csv"))}


def _timer_lines(printed: str) -> list[list[str]]:
    """The timer names of each ``time (ms) | name: ms | ...`` line, in order."""
    return [re.findall(r"\| (\w+): [\d.]+", line) for line in printed.splitlines() if "time (ms)" in line]


def test_monitor_steps_per_print_and_timers_as_deepspeeds_engine(tmp_path, monkeypatch, capsys, caplog):
    """csv_monitor files, progress lines and timer reports of both engines on the same run:
    the same files (and the engine's train_loss: the mean of DeepSpeed's losses over each
    window), steps and lr values, the same lines in the same order; losses within
    fp32 tolerance (both run torch's AdamW arithmetic in fp32; 1e-5 relative leaves room for
    the engine's different summation order of gradients)."""
    accumulation = 2
    results = {}
    for name, reference in (("deepspeed", True), ("megatrain", False)):
        config = {
            **ds_config(accumulation=accumulation),
            "steps_per_print": 2,
            "wall_clock_breakdown": True,
            "csv_monitor": {"enabled": True, "output_path": str(tmp_path / name), "job_name": "job"},
            "zero_optimization": {"stage": 0},
        }
        results[name] = _run(monkeypatch, capsys, caplog, config, reference=reference, accumulation=accumulation)
        results[name] += (_csv_files(tmp_path / name / "job"),)
    (theirs, their_print, their_log, their_csv), (ours, our_print, our_log, our_csv) = (
        results["deepspeed"],
        results["megatrain"],
    )
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6)
    # DeepSpeed 0.19's plain engine writes no train_loss (its pipeline engine and earlier
    # releases do); the engine keeps it: each window's mean loss, at the samples before its step.
    train_loss = our_csv.pop("Train_Samples_train_loss.csv")
    assert our_csv.keys() == their_csv.keys() and "Train_Samples_lr.csv" in our_csv
    assert len(our_csv["Train_Samples_lr.csv"]) == 5  # header + one row per optimizer step
    samples = [int(row[0]) for row in our_csv["Train_Samples_lr.csv"][1:]]
    assert [int(row[0]) for row in train_loss[1:]] == [0, *samples[:-1]]
    window_means = torch.tensor(theirs).view(-1, accumulation).mean(dim=1)
    torch.testing.assert_close(
        torch.tensor([float(row[1]) for row in train_loss[1:]]), window_means, rtol=1e-5, atol=1e-6
    )
    for name in our_csv:
        steps = [row[0] for row in our_csv[name]]
        assert steps == [row[0] for row in their_csv[name]], name
        if name == "Train_Samples_lr.csv":
            assert our_csv[name] == their_csv[name]
    progress = r"step=(\d+), skipped=0, lr=\[[\d.e-]+\], mom=\[\(0\.9, 0\.999\)\]"
    assert re.findall(progress, our_log) == re.findall(progress, their_log) == ["2", "4"]
    assert _timer_lines(our_print) == _timer_lines(their_print)
    assert len(_timer_lines(our_print)) == 4 * accumulation + 4


def test_loss_scale_event_with_fp16(tmp_path):
    """fp16 adds DeepSpeed's Train/Samples/loss_scale event: the scaler's scale after each step."""
    import deepspeed

    config = {
        **ds_config(),
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"},
    }
    engine, *_ = deepspeed.initialize(model=tiny_models.llama(), config=config)
    scales = []
    try:
        for micro in range(3):
            engine.backward(engine(**tiny_models.make_batch(micro)).loss)
            engine.step()
            scales.append(engine.optimizer.loss_scale)
    finally:
        engine.destroy()
    rows = _csv_files(tmp_path / "job")["Train_Samples_loss_scale.csv"]
    assert rows[0] == ["step", "loss_scale"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == [(2 * (i + 1), scale) for i, scale in enumerate(scales)]


def test_a_bad_monitor_block_is_a_config_error():
    import deepspeed

    with pytest.raises(ConfigError, match="csv_monitor"):
        deepspeed.initialize(model=tiny_models.llama(), config={**ds_config(), "csv_monitor": {"enabled": 3}})


# -- no_sync and the training_data loader -----------------------------------------------------


def _no_sync_run(monkeypatch, *, reference: bool) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Accelerate's calls on a 2-micro-batch step, the first inside ``no_sync``, with a
    re-entry and a ``step()`` inside; what each refusal said, and the weights after."""
    import deepspeed

    monkeypatch.setenv("MEGATRAIN_DISABLE_HOOK", "1" if reference else "0")
    torch.manual_seed(0)
    config = ds_config(accumulation=2)
    engine, *_ = deepspeed.initialize(
        model=tiny_models.llama(), config=_reference_config(config) if reference else config
    )
    refusals = []
    try:
        with engine.no_sync():
            engine.backward(engine(**tiny_models.make_batch(0)).loss)
            for refused in (engine.no_sync().__enter__, engine.step):
                # DeepSpeed asserts (AssertionError); the engine raises RuntimeError with its words.
                with pytest.raises((RuntimeError, AssertionError)) as raised:
                    refused()
                refusals.append(str(raised.value))
        engine.step()  # the first micro-batch's step() call, not the boundary: no update yet
        engine.backward(engine(**tiny_models.make_batch(1)).loss)
        engine.step()
        return refusals, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    finally:
        engine.destroy()


def test_no_sync_follows_deepspeeds_rules(monkeypatch):
    """One process, against DeepSpeed's own engine on the same calls: the same refusals
    (re-entry, ``step()`` inside), and the micro-batch inside accumulates into the step
    (a dropped or doubled gradient would move the weights by the update itself, ~lr).

    Tolerance: different arithmetic paths (the engine's gradients come out of a recompute,
    its clipping norm is summed per block), so last-bit differences, as in
    ``test_parity.py``: relative weight error below its 2e-6."""
    ours, theirs = (_no_sync_run(monkeypatch, reference=reference) for reference in (False, True))
    assert (
        ours[0]
        == theirs[0]
        == [
            "no_sync context manager reentry is unsupported",
            "It is illegal to call Engine.step() inside no_sync context manager",
        ]
    )
    # The first micro-batch counted: without it the weights differ from DeepSpeed's by far more.
    diff = sum(((ours[1][k].double() - theirs[1][k].double()) ** 2).sum() for k in theirs[1])
    error = float((diff / sum((theirs[1][k].double() ** 2).sum() for k in theirs[1])).sqrt())
    assert error < 2e-6, error


def test_training_data_is_sharded_as_deepspeeds_loader(tmp_path):
    """2 ranks (gloo; forked after the imports with torchrun's variables, ``forked_ranks.py``):
    each rank's batches are DeepSpeed's DistributedSampler shard (seed 0, the same every
    epoch, drop_last); the shards are disjoint and cover the data. no_sync() with 2 ranks
    gives the same weights as without it."""
    from keys_worker import ROWS

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration_tests"))
    from launching import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    tests = Path(__file__).resolve().parent
    env = fork_server.with_this_checkout(env)
    command = [sys.executable, str(tests / "forked_ranks.py"), "--per-node", "2", "--port", str(free_port())]
    command += [str(tests / "keys_worker.py"), "--out", str(tmp_path)]
    result = fork_server.run(command, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    shards = []
    for rank, out in enumerate(ranks):
        sampler = torch.utils.data.DistributedSampler(range(ROWS), num_replicas=2, rank=rank)
        expected = list(sampler)[: len(sampler) // 2 * 2]  # drop_last: whole micro-batches of 2
        assert out["epochs"] == [[expected[i : i + 2] for i in range(0, len(expected), 2)]] * 2
        shards.append(set(expected))
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) >= ROWS - 3  # padding and drop_last
    for out in ranks:
        assert out["with_no_sync"].keys() == out["without"].keys()
        for key in out["without"]:
            torch.testing.assert_close(torch.tensor(out["with_no_sync"][key]), torch.tensor(out["without"][key]))
    assert "no_sync() does not skip the gradient reduction" in result.stderr
