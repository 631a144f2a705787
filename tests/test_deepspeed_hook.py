"""Zero-code activation: the package's ``.pth`` routes ``deepspeed.initialize`` in scripts
that never import ``megatrain_ds``, in an editable install (this environment) and from a
regular wheel, gives Accelerate's config reader a ZeRO block for the minimal config, and
``MEGATRAIN_DISABLE_HOOK=1`` switches it off."""

import functools
import json
import os
import shutil
import site
import socket
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PTH_NAME = "_megatrain_ds_hook.pth"
PTH_LINE = "import _megatrain_ds_hook; _megatrain_ds_hook.install()\n"

# What a user's script sees when it starts, in a fresh interpreter. Each probe prints JSON
# lines ``[its name, ...]``; the probes of one interpreter run in the order of
# FRESH_PROBES, and each one's checks of what is not imported yet come before the next
# imports it.
START_PROBE = textwrap.dedent("""
    import importlib.util, json, sys
    assert "megatrain_ds" not in sys.modules
    assert importlib.util.find_spec("deepspeed") is not None  # libraries probe like this...
    assert "deepspeed" not in sys.modules                      # ... without importing it
""")
ROUTING_PROBE = textwrap.dedent("""
    from deepspeed import initialize                            # bound once, right after import
    import _megatrain_ds_hook
    print(json.dumps(["routing", hasattr(initialize, "__megatrain_original__"), "megatrain_ds" in sys.modules,
                      _megatrain_ds_hook.__file__]))
""")

MINIMAL = '{"engine": "megatrain", "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}'
# What Accelerate's DeepSpeedPlugin (and through it the HF Trainer) does with a config,
# before anything imports deepspeed.
PLUGIN_PROBE = textwrap.dedent(f"""
    from accelerate.utils import DeepSpeedPlugin
    assert "deepspeed" not in sys.modules
    minimal = json.loads({MINIMAL!r})
    for config in (minimal, {{**minimal, "engine": "deepspeed"}}, {{**minimal, "zero_optimization": {{"stage": 1}}}}):
        try:
            plugin = DeepSpeedPlugin(hf_ds_config=config)
            config = plugin.hf_ds_config.config
            batch = [config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")]
            print(json.dumps(["plugin", [plugin.zero_stage, config.get("zero_optimization"), *batch]]))
        except ValueError as error:
            print(json.dumps(["plugin", str(error)]))
    assert "zero_optimization" not in minimal  # the caller's dict is left alone
    assert "deepspeed" not in sys.modules
""")

# A ZeRO-3 offload config with the engine, through what Accelerate (zero3_init_flag), the
# Trainer and a script using transformers' HfDeepSpeedConfig do before building the model.
ZERO3_PROBE = textwrap.dedent("""
    import os, warnings
    import torch, transformers
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    offload = {"device": "cpu", "pin_memory": True}
    config = {"engine": "megatrain", "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto",
              "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload}}
    os.environ["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = "true"  # accelerate launch with zero3_init_flag: true
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    plugin.set_deepspeed_weakref()  # Accelerator() does this: transformers' ZeRO-3 detection
    tiny = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(tiny)  # under zero.Init if ZeRO-3 is seen
    kept = HfDeepSpeedConfig(config)  # the documented way without Accelerate
    print(json.dumps(["zero3", [plugin.zero_stage, plugin.zero3_init_flag, is_deepspeed_zero3_enabled(),
                      any(hasattr(p, "ds_id") for p in model.parameters()), config["zero_optimization"]["stage"]]]))
    print(json.dumps(["end", "megatrain_ds" in sys.modules]))
""")

FRESH_PROBES = START_PROBE + PLUGIN_PROBE + ROUTING_PROBE + ZERO3_PROBE
"""Every probe in one interpreter (its imports, 4-10 s of CPU, are most of a probe's cost)."""


def _free_port() -> str:
    """A port of the probe's own: this process may hold its MASTER_PORT (an earlier test's group)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def _probe(code: str, python: str = sys.executable, **env: str) -> dict[str, list]:
    """Run ``code`` in a fresh interpreter (``cwd`` "/": no checkout on ``sys.path``); its JSON
    lines by probe name, in order."""
    result = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=300, cwd="/",
        env={**os.environ, "MASTER_PORT": _free_port(), **env},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines: dict[str, list] = {}
    for line in result.stdout.splitlines():
        if line.startswith('["'):  # not what the libraries print
            name, *values = json.loads(line)
            lines.setdefault(name, []).append(values[0] if len(values) == 1 else values)
    return lines


@functools.cache  # several tests read one run of each; none changes it
def _fresh_probes(hook_disabled: bool) -> dict[str, list]:
    """:data:`FRESH_PROBES` with the hook on, or off (``MEGATRAIN_DISABLE_HOOK=1``)."""
    return _probe(FRESH_PROBES, **({"MEGATRAIN_DISABLE_HOOK": "1"} if hook_disabled else {}))


def test_this_environment_routes_without_an_import():
    # Looked up on disk: the checkout's megatrain_ds.egg-info (first on sys.path under
    # pytest) would answer importlib.metadata instead of the installed dist-info.
    pth = [Path(d) / PTH_NAME for d in site.getsitepackages() if (Path(d) / PTH_NAME).is_file()]
    assert pth, f"{PTH_NAME} is not installed: re-run scripts/setup.sh (pip install -e .)"
    assert pth[0].read_text() == PTH_LINE
    [(routed, imported, _)] = _fresh_probes(hook_disabled=False)["routing"]
    assert (routed, imported) == (True, True)


def test_accelerate_reads_the_minimal_config_with_stage_0():
    """Only a megatrain config gets the keys it leaves out (stage 0, "auto" batch and
    accumulation, which Accelerate would otherwise force to 1); the others are Accelerate's."""
    refused = "Please specify the ZeRO optimization config in the DeepSpeed config."
    on, off = _fresh_probes(hook_disabled=False), _fresh_probes(hook_disabled=True)
    assert on["plugin"] == [[0, {"stage": 0}, "auto", "auto"], refused, [1, {"stage": 1}, "auto", "auto"]]
    assert off["plugin"] == [refused, refused, [1, {"stage": 1}, None, 1]]


def test_a_zero3_config_builds_the_model_whole():
    """[Note: ZeRO-3 configs]: with the engine, Accelerate's plugin and transformers read a
    ZeRO-3 megatrain config as stage 0, so ``from_config`` builds the model whole (the
    user's dict still says 3); with the hook off, DeepSpeed's ZeRO-3 partitions it."""
    assert _fresh_probes(hook_disabled=False)["zero3"] == [[0, False, False, False, 3]]
    assert _fresh_probes(hook_disabled=True)["zero3"] == [[3, True, True, True, 3]]


def test_the_hook_can_be_switched_off():
    [(routed, imported, _)] = _fresh_probes(hook_disabled=True)["routing"]
    assert (routed, imported) == (False, False)  # deepspeed untouched, megatrain_ds not loaded
    assert _fresh_probes(hook_disabled=True)["end"] == [False]  # nor by Accelerate or transformers


def _build(tmp_path: Path) -> dict[str, Path]:
    pytest.importorskip("setuptools", minversion="64")  # PEP 660 editable wheels
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "_megatrain_ds_hook.py", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for name in ("megatrain_ds", "triton_kernels"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheels"
    script = f"from setuptools import build_meta as b; b.build_wheel({str(out)!r}); b.build_editable({str(out)!r})"
    result = subprocess.run([sys.executable, "-c", script], cwd=source, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    wheels = {("editable" if "editable" in p.name else "wheel"): p for p in out.glob("*.whl")}
    assert wheels.keys() == {"wheel", "editable"}
    return wheels


def test_both_wheel_kinds_ship_the_pth_at_their_root(tmp_path):
    wheels = _build(tmp_path)
    for kind, path in wheels.items():
        with zipfile.ZipFile(path) as wheel:
            names = wheel.namelist()
            assert wheel.read(PTH_NAME).decode() == PTH_LINE, kind
            record = wheel.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
            assert PTH_NAME in record, kind  # so that pip uninstall removes it
            if kind == "wheel":
                assert "_megatrain_ds_hook.py" in names
            else:  # the editable finder maps the hook module to the checkout
                finder = wheel.read(next(n for n in names if n.endswith("_finder.py"))).decode()
                assert "'_megatrain_ds_hook':" in finder


def _running_site_dirs() -> list[str]:
    """Where the running interpreter finds its installed packages: a virtualenv's own
    site-packages, and the base interpreter's where the virtualenv sees them."""
    return [path for path in sys.path if Path(path).name in ("site-packages", "dist-packages") and Path(path).is_dir()]


def test_a_regular_wheel_install_routes(tmp_path):
    """Install the wheel into a fresh virtual environment that sees this interpreter's
    packages (torch, deepspeed) through a plain-path ``.pth``, whichever environment they
    are installed in (a virtualenv's ``--system-site-packages`` would see the base
    interpreter's instead); its own .pth and hook module route deepspeed.initialize.
    A path line does not run the ``.pth`` files of those directories, so this checkout's
    editable install and hook stay out."""
    wheel = _build(tmp_path)["wheel"]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (venv_site / "running_interpreter_packages.pth").write_text("\n".join(_running_site_dirs()) + "\n")
    # --target, never --prefix: with --prefix pip uninstalls the copy it finds on sys.path
    # (this environment's editable install) before installing.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--target",
            str(venv_site),
            str(wheel),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    # PYTHONPATH (a worktree's checkout) would come before the wheel's copy.
    [(routed, imported, hook_file)] = _probe(START_PROBE + ROUTING_PROBE, str(python), PYTHONPATH="")["routing"]
    assert (routed, imported) == (True, True)
    assert Path(hook_file).is_relative_to(venv)  # the wheel's copy, not this checkout's
