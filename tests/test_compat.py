"""The third-party patches (``megatrain_ds/integration/compat.py``): each one's contract
taken away in turn stops it with a clear error, nothing else in the package patches a
third-party module, and the supported ranges are ``pyproject.toml``'s.

No engine is built here: each contract is broken with ``monkeypatch`` on the real, installed
DeepSpeed and Accelerate (restored after the test), and the patch or its check is called
directly.
"""

from __future__ import annotations

import ast
import re
import sys
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace

import accelerate.utils.deepspeed as accelerate_deepspeed
import deepspeed
import deepspeed.runtime.fp16.loss_scaler as loss_scaler
import pytest
import torch
import transformers.integrations.deepspeed as transformers_deepspeed
import transformers.trainer as trainer_module

import _megatrain_ds_hook
from megatrain_ds.integration import compat
from megatrain_ds.integration.compat import IncompatibleVersionError

REPO_ROOT = Path(__file__).resolve().parents[1]


def _clear_error(package: str) -> str:
    """The message names the package's installed version and its supported range."""
    low, high = compat.SUPPORTED[package]
    version = compat.installed_version(package).replace(".", r"\.")
    return rf"{package} {version} breaks it \(supported: {package}>={low},<{high}\)"


def test_the_patches_are_applied_in_this_process():
    """The start-up hook (or ``import megatrain_ds``) ran every patch on the real modules."""
    marker = "__megatrain_original__"
    assert hasattr(deepspeed.initialize, marker)
    assert hasattr(deepspeed.zero.Init, marker)
    assert hasattr(deepspeed.zero.GatheredParameters, marker)
    assert hasattr(deepspeed.comm.get_rank, marker)
    assert hasattr(accelerate_deepspeed.HfDeepSpeedConfig.__init__, marker)
    assert hasattr(trainer_module.deepspeed_init, marker)


def test_initialize_without_its_config_arguments_is_refused(monkeypatch):
    def initialize(model, config):  # no args=, no config_params=
        return model, config

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    with pytest.raises(IncompatibleVersionError, match=_clear_error("deepspeed")):
        compat.route_initialize(deepspeed)
    assert deepspeed.initialize is initialize  # nothing changed
    monkeypatch.delattr(deepspeed, "initialize")
    with pytest.raises(IncompatibleVersionError, match=r"deepspeed\.initialize is a function"):
        compat.route_initialize(deepspeed)


def test_zero_init_without_its_config_argument_is_refused(monkeypatch):
    class Init:
        def __init__(self, module=None, enabled=True):  # config_dict_or_path renamed away
            pass

    monkeypatch.setattr(deepspeed.zero, "Init", Init)
    with pytest.raises(IncompatibleVersionError, match=_clear_error("deepspeed")):
        compat.build_models_whole(deepspeed)
    assert deepspeed.zero.Init is Init
    monkeypatch.setattr(deepspeed.zero, "Init", lambda **kwargs: None)  # not a class
    with pytest.raises(IncompatibleVersionError, match=r"deepspeed\.zero\.Init is a class"):
        compat.build_models_whole(deepspeed)


def test_gathered_parameters_that_is_no_context_manager_is_refused(monkeypatch):
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", lambda *params: None)  # not a class
    with pytest.raises(IncompatibleVersionError, match=r"GatheredParameters is a class used as a context manager"):
        compat.settle_before_gathering(deepspeed)


def test_a_rank_query_the_scalers_do_not_call_through_deepspeed_comm_is_refused(monkeypatch):
    """Patch 3 only reaches the loss scalers and monitors if they call ``deepspeed.comm``'s
    module attribute; a scaler that bound its own ``dist`` would still assert."""
    monkeypatch.setattr(loss_scaler, "dist", SimpleNamespace(get_rank=lambda group=None: 0))
    with pytest.raises(IncompatibleVersionError, match=_clear_error("deepspeed")):
        compat.answer_rank_without_backend(deepspeed)
    monkeypatch.undo()
    monkeypatch.delattr(deepspeed.comm, "get_rank")
    with pytest.raises(IncompatibleVersionError, match=r"deepspeed\.comm has get_rank"):
        compat.answer_rank_without_backend(deepspeed)
    assert not hasattr(deepspeed.comm, "get_rank")


def test_hf_deepspeed_config_without_set_stage_and_offload_is_refused(monkeypatch):
    monkeypatch.delattr(accelerate_deepspeed.HfDeepSpeedConfig, "set_stage_and_offload")
    with pytest.raises(IncompatibleVersionError, match=_clear_error("accelerate")):
        compat.complete_megatrain_configs(accelerate_deepspeed)


def test_a_trainer_that_no_longer_calls_its_deepspeed_init_global_is_refused(monkeypatch):
    """Patch 6 reaches the Trainer's evaluation only through the module global that
    ``Trainer.evaluation_loop`` calls, and needs transformers' ``trainer_config_finalize``."""

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None):
        return None  # a release that prepares DeepSpeed some other way

    monkeypatch.setattr(trainer_module.Trainer, "evaluation_loop", evaluation_loop)
    with pytest.raises(IncompatibleVersionError, match=_clear_error("transformers")):
        compat.evaluate_before_training(trainer_module)
    monkeypatch.undo()
    compat.check_evaluation_init(trainer_module)  # the installed transformers keeps it
    monkeypatch.delattr(transformers_deepspeed.HfTrainerDeepSpeedConfig, "trainer_config_finalize")
    with pytest.raises(IncompatibleVersionError, match=r"has trainer_config_finalize\(args, model"):
        compat.check_evaluation_init(trainer_module)


def test_evaluation_before_training_readies_megatrain_configs_only(monkeypatch):
    """The patched ``deepspeed_init`` (on a stand-in module holding a recording original):
    for a megatrain config and ``inference=True`` it finalizes the config and drops its
    ``"optimizer"`` block, calling no original; every other call is the original's, unchanged
    (training, a DeepSpeed config, the hook disabled)."""
    calls = []
    module = ModuleType("transformers.trainer")
    module.Trainer = trainer_module.Trainer
    module.deepspeed_init = lambda trainer, num_training_steps, inference=False: calls.append(inference) or "original"
    compat.evaluate_before_training(module)

    def trainer_with(config: dict) -> SimpleNamespace:
        finalize = lambda args, model, steps: calls.append(("finalize", args, model, steps))  # noqa: E731
        hf_config = SimpleNamespace(config=config, trainer_config_finalize=finalize)
        state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(hf_ds_config=hf_config))
        return SimpleNamespace(accelerator=SimpleNamespace(state=state), args="A", model="M")

    megatrain = {"engine": "megatrain", "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}}
    trainer = trainer_with(megatrain)
    assert module.deepspeed_init(trainer, num_training_steps=0, inference=True) == (None, None)
    assert calls == [("finalize", "A", "M", 0)] and set(megatrain) == {"engine", "scheduler"}
    calls.clear()
    assert module.deepspeed_init(trainer, num_training_steps=4) == "original"
    assert module.deepspeed_init(trainer_with({"optimizer": {}}), num_training_steps=0, inference=True) == "original"
    monkeypatch.setenv("MEGATRAIN_DISABLE_HOOK", "1")
    assert module.deepspeed_init(trainer_with({"engine": "megatrain"}), 0, inference=True) == "original"
    assert calls == [False, True, True]


def test_the_start_up_hook_stops_the_import_with_the_error(monkeypatch):
    """A broken contract is not swallowed by the hook (a megatrain config would otherwise train
    on DeepSpeed's own engine): the watched module's import fails with compat's error."""
    monkeypatch.delattr(accelerate_deepspeed.HfDeepSpeedConfig, "set_stage_and_offload")
    with pytest.raises(IncompatibleVersionError, match="MEGATRAIN_DISABLE_HOOK=1"):
        _megatrain_ds_hook._patch(accelerate_deepspeed)


def test_the_rank_query_answers_only_where_deepspeed_would_assert(monkeypatch):
    """Without DeepSpeed's backend the patched query answers torch.distributed's rank (none
    here: 0) where DeepSpeed's own asserts; with a backend, DeepSpeed's own answers."""
    comm = deepspeed.comm
    deepspeeds_own = comm.get_rank.__megatrain_original__
    backend_state = sys.modules["deepspeed.comm.comm"]  # where get_rank/is_initialized read `cdb`
    monkeypatch.setattr(backend_state, "cdb", None)  # DeepSpeed's backend not initialised
    # Nor torch.distributed's, even where an earlier test on this worker joined a group (a
    # DeepSpeed reference run): the patched query must answer 0 without one.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(AssertionError, match="DeepSpeed backend not set"):
        deepspeeds_own()
    assert comm.get_rank() == 0
    backend = SimpleNamespace(is_initialized=lambda: True, get_rank=lambda group=None: 5)
    monkeypatch.setattr(backend_state, "cdb", backend)
    assert comm.get_rank() == deepspeeds_own() == 5
    # What DeepSpeed's scaler does with it on an overflow: halves the scale (logged on rank 0).
    monkeypatch.setattr(backend_state, "cdb", None)
    scaler = loss_scaler.DynamicLossScaler(
        init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=1, consecutive_hysteresis=False
    )
    scaler.update_scale(True)
    assert scaler.cur_scale == 2.0**15


def test_supported_ranges_are_pyprojects_bounds():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    bounds = {}
    for requirement in project["dependencies"]:
        name, _, spec = requirement.partition(">=")
        low, _, high = spec.partition(",<")
        bounds[name] = (low, high)
    for package, supported in compat.SUPPORTED.items():
        assert bounds[package] == supported, package


def test_the_lowest_versions_script_installs_the_lower_bounds():
    """``scripts/test_lowest.sh`` tests what ``SUPPORTED`` claims: each package pinned at its
    lowest supported version (``1.0.0`` is ``1.0``)."""
    from packaging.version import Version

    script = (REPO_ROOT / "scripts" / "test_lowest.sh").read_text()
    pins = dict(re.findall(r"\b([a-z][a-z0-9_-]*)==([0-9][0-9.]*)", script))
    for package, (low, _) in compat.SUPPORTED.items():
        assert package in pins and Version(pins[package]) == Version(low), (package, pins.get(package), low)


def _third_party_names(tree: ast.Module) -> set[str]:
    """Names a module binds to DeepSpeed, Accelerate or transformers objects by importing."""
    frameworks = ("deepspeed", "accelerate", "transformers")
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in frameworks:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in frameworks:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_only_compat_patches_third_party_modules():
    """No module but ``integration/compat.py`` assigns (or ``setattr``s, or deletes) an
    attribute of anything it imported from DeepSpeed, Accelerate or transformers."""
    offending = []
    for path in sorted((REPO_ROOT / "megatrain_ds").rglob("*.py")):
        if path.name == "compat.py" and path.parent.name == "integration":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = _third_party_names(tree)
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
                setter = node.func.id in ("setattr", "delattr")
                targets = [ast.Attribute(value=node.args[0], attr="?")] if setter else []
            for target in targets:
                if isinstance(target, ast.Attribute) and _root_name(target) in imported:
                    offending.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert not offending, offending


def test_the_first_write_through_deepspeeds_op_runs_alone(monkeypatch):
    """``state/swap_io.py``: a second first writer waits for the first (on a lock that
    releases the GIL) instead of entering DeepSpeed's warning ``call_once`` beside it; once
    the first is done, writers no longer wait."""
    from megatrain_ds.state import swap_io

    monkeypatch.setattr(swap_io, "_first_write_done", threading.Event())
    inside, release, order = threading.Event(), threading.Event(), []

    def first() -> None:
        with swap_io._first_write_alone():
            inside.set()
            release.wait(10)
            order.append("first")

    def second() -> None:
        inside.wait(10)
        with swap_io._first_write_alone():
            order.append("second")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    inside.wait(10)
    threads[1].join(0.2)  # the second must still be waiting for the first
    assert order == [] and threads[1].is_alive()
    release.set()
    for thread in threads:
        thread.join(10)
    assert order == ["first", "second"] and swap_io._first_write_done.is_set()
    with swap_io._first_write_alone():  # done: does not take the lock
        assert not swap_io._FIRST_WRITE_LOCK.locked()


def test_a_broken_contract_leaves_deepspeed_unpatched():
    """``patch`` checks every contract of ``deepspeed``'s patches before it applies any: a
    release that broke the last one (here ``GatheredParameters``, patch 5) gets the error and
    keeps its own ``initialize`` and ``zero.Init`` (patches 1 and 2), not half the patches.
    On a stand-in module holding DeepSpeed's originals (this process's are patched already)."""
    originals = SimpleNamespace(
        initialize=deepspeed.initialize.__megatrain_original__,
        init=deepspeed.zero.Init.__megatrain_original__,
    )
    release = ModuleType("deepspeed")
    release.initialize = originals.initialize
    release.zero = SimpleNamespace(Init=originals.init, GatheredParameters=lambda *params: None)
    release.comm = deepspeed.comm
    with pytest.raises(IncompatibleVersionError, match=r"GatheredParameters is a class used as a context manager"):
        compat.patch(release)
    assert release.initialize is originals.initialize and release.zero.Init is originals.init
