"""Checkpoints from someone else: nothing unpickled, names confined, damage refused clearly.

The attacker here writes every file of a checkpoint directory, the manifest included, so
each test re-stamps the manifest's sizes and checksums after its change (``restamp``): the
CRCs stop corruption, not forgery, and what must stop a forgery is the checks behind them.
Comparisons of loaded state are bitwise (the same engine, saved and loaded on one machine).
"""

import json
import os
import pickle
import random
import shutil
import sys
import zlib
from pathlib import Path

import checkpoint_worker
import fork_server
import numpy
import pytest
import tiny_models
import torch

from megatrain_ds import ConfigError
from megatrain_ds.checkpoint.directories import LATEST_FILE, MANIFEST_FILE
from megatrain_ds.checkpoint.safetensors_source import SafetensorsSource
from megatrain_ds.checkpoint.tensor_files import CheckpointError
from megatrain_ds.checkpoint.trainer_state import ENGINE_STATE, ENGINE_TENSORS, LEGACY_TRAINER_STATE

TESTS = Path(__file__).parent
WORKER_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")])),
}
CLIENT_STATE = checkpoint_worker.CLIENT_STATE  # what the saved fixture (conftest.py) saved

pytestmark = pytest.mark.usefixtures("cpu_single_thread")


class _Payload:
    """Unpickling this creates ``marker``: a stand-in for running an attacker's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "x"))


def _payload_bytes(marker: Path, how: str) -> bytes:
    if how == "torch.save":
        path = marker.parent / "payload.pt"
        torch.save({"counters": _Payload(marker)}, path)
        return path.read_bytes()
    return pickle.dumps({"counters": _Payload(marker)})


def restamp(tag_dir: Path, version: int | None = None, drop: tuple[str, ...] = ()) -> None:
    """Rewrite the manifest as an attacker (or the old code) would: every listed file's size
    and checksums as they are now, ``drop`` left out, every other file of the directory in."""
    document = json.loads((tag_dir / MANIFEST_FILE).read_text())
    body = document["body"]
    if version is not None:
        body["version"] = version
    names = sorted(p.name for p in tag_dir.iterdir() if p.name != MANIFEST_FILE and p.name not in drop)
    body["files"] = {name: record(tag_dir / name) for name in names}
    document["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    (tag_dir / MANIFEST_FILE).write_text(json.dumps(document))


def record(path: Path) -> dict:
    data = path.read_bytes()
    entry = {"bytes": len(data), "crc32": zlib.crc32(data)}
    if path.suffix == ".safetensors":
        entry["header_crc32"] = zlib.crc32(data[: 8 + int.from_bytes(data[:8], "little")])
    return entry


@pytest.fixture
def copy(saved, tmp_path):
    shutil.copytree(saved.root, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture
def fresh():
    engine = checkpoint_worker.build(seed=1)
    yield engine
    engine.destroy()


# -- no pickle ---------------------------------------------------------------------------------


@pytest.mark.parametrize("module_only", [False, True])
@pytest.mark.parametrize("where", ["legacy torch.save", "legacy pickle", "engine_state.json"])
def test_a_malicious_pickle_is_refused_and_never_run(copy, fresh, tmp_path, where, module_only):
    marker = tmp_path / "pwned"
    payload = _payload_bytes(marker, "torch.save" if where == "legacy torch.save" else "pickle")
    pickle.loads(pickle.dumps(_Payload(tmp_path / "proof")))  # the payload works when unpickled...
    assert (tmp_path / "proof").exists()
    tag_dir = copy / "good"
    if where == "engine_state.json":
        (tag_dir / ENGINE_STATE).write_bytes(payload)
        restamp(tag_dir)
        message = f"{ENGINE_STATE}: not a valid JSON document"
    else:  # a version-1 checkpoint, whose trainer state was a pickle
        (tag_dir / ENGINE_STATE).unlink()
        (tag_dir / ENGINE_TENSORS).unlink()
        (tag_dir / LEGACY_TRAINER_STATE).write_bytes(payload)
        restamp(tag_dir, version=1)
        message = f"{LEGACY_TRAINER_STATE}: the file holds objects a safe load refuses"
    with pytest.raises(CheckpointError, match=message):
        fresh.load_checkpoint(copy, load_module_only=module_only)
    assert not marker.exists()  # ...and here it was never unpickled


def test_a_pickle_beside_a_current_checkpoint_is_never_opened(copy, fresh, saved, tmp_path):
    marker = tmp_path / "pwned"
    (copy / "good" / LEGACY_TRAINER_STATE).write_bytes(_payload_bytes(marker, "torch.save"))
    restamp(copy / "good")  # listed in the manifest, with its right checksum
    fresh.load_checkpoint(copy)
    assert not marker.exists()
    checkpoint_worker_state = checkpoint_worker.host_state(saved.engine)
    for key, value in checkpoint_worker.host_state(fresh).items():
        assert torch.equal(value, checkpoint_worker_state[key]), key


def _old_trainer_state(engine, client_state):
    """Exactly what the version-1 code's ``_trainer_state`` pickled."""
    return {
        "counters": {
            name: getattr(engine, name)
            for name in ("global_steps", "global_samples", "micro_steps", "skipped_steps", "optimizer_steps")
            if hasattr(engine, name)
        },
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups],
        "lr_scheduler": engine.lr_scheduler.state_dict(),
        "rng": {"python": random.getstate(), "cpu": torch.get_rng_state(), "numpy": numpy.random.get_state()},
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "mid_window_gradients": engine.micro_steps % engine.gradient_accumulation_steps() != 0,
        "client_state": dict(client_state),
    }


def _make_legacy(tag_dir: Path, state: dict) -> None:
    """Turn a tag directory into what the version-1 code wrote (the same tensor files)."""
    (tag_dir / ENGINE_STATE).unlink()
    (tag_dir / ENGINE_TENSORS).unlink()
    torch.save(state, tag_dir / LEGACY_TRAINER_STATE)
    restamp(tag_dir, version=1)


def test_a_version_1_checkpoint_loads_exactly(tmp_path):
    """Saved mid-window (the accumulators are in it), then resumed: the same losses, weights,
    moments, counters, scheduler and RNG states as the uninterrupted engine."""
    engine = checkpoint_worker.build(seed=0)
    fresh = checkpoint_worker.build(seed=1)
    try:
        checkpoint_worker.train(engine, 1)
        engine.backward(engine(**tiny_models.make_batch(engine.micro_steps)).loss)
        engine.step()
        client_state = {"epoch": 1, "order": [3, 1, 2], "weights": torch.ones(2)}
        engine.save_checkpoint(tmp_path, tag="old")
        _make_legacy(tmp_path / "old", _old_trainer_state(engine, client_state))
        rng = (random.getstate(), torch.get_rng_state(), numpy.random.get_state()[1].copy())
        losses = checkpoint_worker.train(engine, 2)
        torch.manual_seed(99)
        random.seed(99)
        numpy.random.seed(99)
        path, loaded_client_state = fresh.load_checkpoint(tmp_path)
        assert path == str(tmp_path / "old")
        assert loaded_client_state.keys() == client_state.keys() and loaded_client_state["order"] == [3, 1, 2]
        assert torch.equal(loaded_client_state["weights"], client_state["weights"])
        assert random.getstate() == rng[0] and torch.equal(torch.get_rng_state(), rng[1])
        assert (numpy.random.get_state()[1] == rng[2]).all()
        assert checkpoint_worker.train(fresh, 2) == losses
        assert (fresh.global_steps, fresh.micro_steps, fresh.optimizer_steps) == (
            engine.global_steps,
            engine.micro_steps,
            engine.optimizer_steps,
        )
        assert fresh.lr_scheduler.state_dict() == engine.lr_scheduler.state_dict()
        for key, value in checkpoint_worker.host_state(engine).items():
            assert torch.equal(value, checkpoint_worker.host_state(fresh)[key]), key
    finally:
        engine.destroy()
        fresh.destroy()


def test_a_version_1_checkpoint_with_other_objects_is_refused(copy, fresh, saved):
    import datetime

    state = _old_trainer_state(saved.engine, {"when": datetime.date(2026, 1, 1)})
    _make_legacy(copy / "good", state)
    with pytest.raises(CheckpointError, match="holds objects a safe load refuses.*datetime"):
        fresh.load_checkpoint(copy)


def test_client_state_round_trips_and_unstorable_values_fail_the_save(copy, fresh, saved, tmp_path):
    _, client_state = fresh.load_checkpoint(copy)
    assert client_state.keys() == CLIENT_STATE.keys()
    for key, value in CLIENT_STATE.items():
        assert type(client_state[key]) is type(value), key
        assert torch.equal(client_state[key], value) if key == "t" else client_state[key] == value, key
    with pytest.raises(ValueError, match=r"client_state\['sampler'\]\['order'\]: cannot save a builtins.set"):
        saved.engine.save_checkpoint(tmp_path / "new", tag="bad", client_state={"sampler": {"order": {1, 2}}})
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


# -- names confined to their directory -----------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["../outside.safetensors", "model-x/../../outside.safetensors", "/abs/model-00001.safetensors", "..", "a\\b"],
)
def test_manifest_names_outside_the_tag_directory_are_refused(copy, fresh, name):
    tag_dir = copy / "good"
    shutil.copy(next(tag_dir.glob("model-*.safetensors")), copy / "outside.safetensors")
    document = json.loads((tag_dir / MANIFEST_FILE).read_text())
    document["body"]["files"][name] = record(copy / "outside.safetensors")
    document["crc32"] = zlib.crc32(json.dumps(document["body"], sort_keys=True).encode())
    (tag_dir / MANIFEST_FILE).write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match="is not a plain file name inside the tag directory"):
        fresh.load_checkpoint(copy)


@pytest.mark.parametrize("tag", ["../elsewhere", "/abs/elsewhere", "..", ".hidden", "good/.."])
def test_latest_naming_a_directory_outside_is_refused(copy, fresh, saved, tag):
    shutil.copytree(saved.root / "good", copy.parent / "elsewhere")  # a complete checkpoint it would reach
    (copy / LATEST_FILE).write_text(tag)
    with pytest.raises(CheckpointError, match=f"{LATEST_FILE} names .*, not a tag directory inside"):
        fresh.load_checkpoint(copy)


@pytest.mark.parametrize("shard", ["../outside/model.safetensors", "/abs/model.safetensors", "sub/model.safetensors"])
def test_load_from_index_names_outside_the_directory_are_refused(tmp_path, shard):
    directory = tmp_path / "hf"
    tiny_models.llama(num_layers=1).save_pretrained(directory, max_shard_size="20KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = shard
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=f"puts tensor '{name}' in .*, not a plain file name inside"):
        SafetensorsSource(directory)


# -- forged fields and the fuzz -------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, value",
    [
        (["counters", "global_steps"], "3"),
        (["counters", "micro_steps"], -1),
        (["param_groups", 0, "lr"], "fast"),
        (["param_groups", 0, "params"], [0]),
        (["param_groups", 0, "betas"], {"$tuple": [0.9]}),
        (["lr_scheduler", "optimizer"], None),
        (["lr_scheduler", "last_epoch"], [1]),
        (["rng", "python"], {"$tuple": [3, [1, 2], None]}),
        (["rng", "cpu"], {"$tensor": "missing"}),
        (["rng", "numpy", "keys"], [1, 2]),
        (["gradient_accumulation_steps"], 0),
        (["mid_window_gradients"], 1),
        (["client_state"], [1]),
        (["extra"], 1),
    ],
)
def test_forged_engine_state_fields_are_refused(copy, fresh, path, value):
    """A field set to a value the engine cannot restore, with the checksums re-stamped."""
    state_file = copy / "good" / ENGINE_STATE
    document = json.loads(state_file.read_text())
    node = document
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    state_file.write_text(json.dumps(document))
    restamp(copy / "good")
    with pytest.raises(CheckpointError, match=rf"/good(/{ENGINE_STATE})?: "):
        fresh.load_checkpoint(copy)


def test_fuzz_every_damaged_checkpoint_is_refused_clearly_or_loads_exactly(tmp_path):
    """300 seeded cases, half of them forged; see checkpoint_fuzz_worker.py. In a subprocess
    with a timeout, so a crash or a hang fails the test instead of ending the run."""
    command = [sys.executable, str(TESTS / "checkpoint_fuzz_worker.py"), str(tmp_path), "300"]
    result = fork_server.run(command, cwd=TESTS, env=WORKER_ENV, timeout=240)
    assert result.stdout, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["failures"] == [] and result.returncode == 0, summary["failures"][:10]
    assert summary["cases"] == 300 and sum(summary["results"].values()) == 300
    # Both outcomes occur, forged or not: the damage reaches the checks, and loads still work.
    assert all(summary["results"].get(key, 0) > 10 for key in ("loaded", "CheckpointError")), summary
    assert all(summary["results"].get(key, 0) > 10 for key in ("loaded (forged)", "CheckpointError (forged)"))
    assert set(summary["results"]) <= {"loaded", "CheckpointError", "loaded (forged)", "CheckpointError (forged)"}
