"""``bench/compare.py``'s fairness: every system starts from the same weights.

The harness fills each parameter from a generator seeded by its name, so the weights do
not depend on the order a system builds its modules in, nor on the global RNG (DeepSpeed's
``zero.Init`` builds partitioned modules on which Hugging Face's own init never runs). Its
end-to-end check (every system's first loss side by side) runs with the bench itself.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import tiny_models
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "compare.py"


def _compare_module():
    spec = importlib.util.spec_from_file_location("compare_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_same_initial_weights_ignore_the_global_rng_and_match_hf_init_statistics():
    compare = _compare_module()
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = tiny_models.llama(2)
        compare.same_initial_weights(model)
        models.append(dict(model.named_parameters()))
    first, second = models
    for name, param in first.items():
        assert torch.equal(param, second[name]), name  # the same generator, seed and op: bit-equal
    norms = [p for name, p in first.items() if "norm" in name]
    assert norms and all(bool((p == 1).all()) for p in norms)
    matrices = torch.cat([p.detach().reshape(-1) for name, p in first.items() if "norm" not in name])
    # Tens of thousands of normal draws: the sample std is within a few percent of HF's 0.02.
    assert abs(float(matrices.std()) - compare.INIT_STD) < 0.002
    names = [name for name in first if "norm" not in name]
    assert not torch.equal(first[names[0]].reshape(-1)[:16], first[names[1]].reshape(-1)[:16]), "seeded per name"


def test_same_initial_weights_fill_through_the_gather_context():
    """ZeRO-3's path: each parameter written inside ``gathered(param)``, one at a time."""
    compare = _compare_module()
    torch.manual_seed(0)
    model = tiny_models.llama(2)
    opened: list[str] = []

    class Gathered:
        def __init__(self, param: torch.nn.Parameter) -> None:
            self.param = param

        def __enter__(self) -> None:
            opened.append(next(n for n, p in model.named_parameters() if p is self.param))

        def __exit__(self, *exc: object) -> None:
            return None

    compare.same_initial_weights(model, Gathered)
    assert opened == [name for name, _ in model.named_parameters()]
    reference = tiny_models.llama(2)
    compare.same_initial_weights(reference)
    for (name, param), other in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param, other), name


def _planner_in_process(monkeypatch, compare, commands: list[list[str]]) -> None:
    """``compare.run_planner``'s ``megatrain plan`` run in this process (the same ``main``
    its subprocess runs), recording each command line."""
    import contextlib
    import io
    import subprocess

    from megatrain_ds import cli

    real = subprocess.run

    def run(command, *args, **kwargs):
        if list(command[1:4]) != ["-m", "megatrain_ds.cli", "plan"]:
            return real(command, *args, **kwargs)  # the module is shared: others' calls pass through
        commands.append(command)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(command[3:])
        return subprocess.CompletedProcess(command, code, out.getvalue(), "")

    monkeypatch.setattr(compare.subprocess, "run", run)


def test_every_engine_round_gets_the_floor_and_with_the_planner_one_measurement(monkeypatch, tmp_path):
    """Issue 42, item 6: the floor is recorded for every engine system, with ``--no-planner``
    too (from the declared figures, nothing measured), and equals the largest bound of the
    step-time model computed here from the figures it names. With the planner on, the first
    engine round measures the machine and every later round reuses those figures."""
    from megatrain_ds import cli
    from megatrain_ds.planning.planner import Hardware, RunSettings
    from megatrain_ds.planning.step_time import step_seconds

    compare = _compare_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the planner's CPU target, also on a GPU machine
    monkeypatch.setattr("megatrain_ds.optimizer.placement.cache_path", lambda: tmp_path / "calibration.json")
    measured = []

    def fake_measure(config, block_path, profiled, dtype, seconds):
        measured.append(profiled.tokens_per_pass)
        return {
            "flops": 1e11,
            "head_flops": 5e10,
            "block_efficiency": 0.5,
            "copy_bytes_per_s": 1e10,
            "adam_bytes_per_s": 3e10,
        }

    monkeypatch.setattr(cli, "_measure_profile", fake_measure)
    commands: list[list[str]] = []
    _planner_in_process(monkeypatch, compare, commands)
    model = ["--hidden", "64", "--intermediate", "128", "--layers", "2", "--vocab", "256", "--seq-len", "16"]
    shape = cli.shape_of(cli.load_meta_model(_write_config(compare, model, tmp_path)))
    settings = RunSettings(seq_len=16, micro_batch=2, bf16=False)

    def engine_round(step: float) -> dict:
        return {
            "step_seconds": step,
            "params": shape.params,
            "tokens_per_s": 32 / step,
            "peak_host_bytes": 1 << 20,
            "optimizer_placement": {"elements_by_kernel": {"DeepSpeedKernel": shape.params}},
        }

    declared = compare._parser().parse_args([*model, "--no-planner"])
    result = engine_round(0.5)
    compare.add_planner_figures(result, declared, tmp_path / "figures.json")
    assert "--recalibrate" not in commands[-1] and "--probe" not in commands[-1] and "--hardware" not in commands[-1]
    assert "predicted_step_seconds" not in result and result["floor_figures"] == "declared"
    floor = max(step_seconds(shape, settings, Hardware(**result["floor_hardware"])).values())
    assert result["floor_seconds"] == pytest.approx(floor) and result["step_over_floor"] == pytest.approx(0.5 / floor)
    # A round that stashed blocks ("recompute": "none") is planned with them stashed.
    stashing = {**engine_round(0.5), "stashed_blocks": 2}
    compare.add_planner_figures(stashing, declared, tmp_path / "figures.json")
    assert commands[-1][commands[-1].index("--stashed-blocks") + 1] == "2"
    stashed = RunSettings(seq_len=16, micro_batch=2, bf16=False, stashed_blocks=2)
    floor = max(step_seconds(shape, stashed, Hardware(**stashing["floor_hardware"])).values())
    assert stashing["floor_seconds"] == pytest.approx(floor) != result["floor_seconds"]

    planned = compare._parser().parse_args(model)
    figures = tmp_path / "measured.json"
    first, second = engine_round(0.5), engine_round(0.7)
    before = len(measured)
    compare.add_planner_figures(first, planned, figures)
    assert "--recalibrate" in commands[-1] and figures.exists()
    compare.add_planner_figures(second, planned, figures)
    assert commands[-1][commands[-1].index("--hardware") + 1] == str(figures)
    assert len(measured) == before + 1  # measured once, reused by the second round
    assert first["planner_hardware"] == second["planner_hardware"] == second["floor_hardware"]
    # The blocks' rate in the run, by the probe's definition, from its compute spans.
    with_trace = {**engine_round(0.5), "trace_split": {"compute": 0.25}, "block_params": shape.total_block_params}
    compare.add_planner_figures(with_trace, planned, figures)
    in_run = 8 * shape.total_block_params * 32 / with_trace["planner_hardware"]["flops"] / 0.25
    assert with_trace["block_efficiency_in_run"] == pytest.approx(in_run)
    assert with_trace["block_efficiency_probe_over_run"] == pytest.approx(0.5 / in_run)  # the profile's 0.5
    for run in (first, second):
        assert run["floor_figures"] == "measured" and "predicted_step_seconds" in run
        assert run["floor_seconds"] == pytest.approx(max(run["predicted_by_part"].values()))
    assert "read from" in second["planner_hardware_sources"]["all"]


def _write_config(compare, model_args: list[str], folder: Path) -> str:
    path = folder / "config.json"
    path.write_text(json.dumps(compare._llama_config(compare._parser().parse_args(model_args))))
    return str(path)


def test_placement_decisions_are_heard_from_every_module_that_logs_one():
    """The JSON's ``optimizer_placement.decision`` holds each placement decision the engine
    logs, wherever the code logging it lives: every module of the package whose source logs a
    ``"megatrain: device_state"`` or ``"megatrain: optimizer"`` line is found here, and a
    line sent through that module's own logger must reach the handler (the GPU tier's line
    moved to ``optimizer_build.py`` and a handler on the old module's logger missed it)."""
    import importlib
    import logging

    import megatrain_ds

    compare = _compare_module()
    package = Path(megatrain_ds.__file__).parent
    modules = sorted(
        ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for path in package.rglob("*.py")
        if any(prefix in path.read_text() for prefix in ('"megatrain: device_state', '"megatrain: optimizer'))
    )
    assert "megatrain_ds.optimizer_build" in modules and "megatrain_ds.optimizer.placement" in modules
    package_logger = logging.getLogger("megatrain_ds")
    level = package_logger.level
    handler = compare.PlacementDecisions.attach()
    try:
        for name in modules:
            importlib.import_module(name).logger.info("megatrain: device_state %r: from %s", "auto", name)
        importlib.import_module(modules[0]).logger.info("megatrain: speculative steps journal (not a decision)")
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(level)
    assert handler.messages == [f"megatrain: device_state 'auto': from {name}" for name in modules]


@pytest.mark.parametrize("failure", ["exit", "hang", "noise"])
def test_a_planner_that_fails_is_recorded_in_the_round_and_the_benchmark_goes_on(monkeypatch, tmp_path, failure):
    """A GPU session has minutes: a ``megatrain plan`` call that exits with an error, hangs
    (stopped at ``PLANNER_TIMEOUT_S``) or prints something that is not JSON must leave its
    reason in the round (``planner_error``), not end the benchmark, and leave no figures
    file for the later rounds to reuse; a measuring call that failed is not made again."""
    import subprocess

    compare = _compare_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []

    def run(command, *args, **kwargs):
        calls.append(command)
        assert kwargs.get("timeout") == compare.PLANNER_TIMEOUT_S
        if failure == "hang":
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        if failure == "exit":
            return subprocess.CompletedProcess(command, 1, "", "Traceback ...\nRuntimeError: probe failed")
        return subprocess.CompletedProcess(command, 0, "a warning on stdout\n{", "")

    monkeypatch.setattr(compare.subprocess, "run", run)
    result = {"step_seconds": 0.5, "optimizer_placement": {}}
    for no_planner in ([], ["--no-planner"]):
        args = compare._parser().parse_args(["--layers", "2", *no_planner])
        compare.add_planner_figures(result, args, tmp_path / "figures.json")
        expected = {"exit": "exit 1: Traceback", "hang": "no answer in 300 s", "noise": "not JSON"}[failure]
        assert result.pop("planner_error").startswith(expected)
        assert set(result) == {"step_seconds", "optimizer_placement"}  # nothing half-written
        assert not (tmp_path / "figures.json").exists()
    measuring = compare._parser().parse_args(["--layers", "2"])
    compare.add_planner_figures(result, measuring, tmp_path / "figures.json")  # a later round
    assert len(calls) == 2 and result["planner_error"].startswith("not run: an earlier round's measuring call")


def test_the_blocks_rate_in_the_run_leaves_out_the_recompute_of_stashed_blocks():
    """``block_efficiency_in_run`` counts the FLOPs the run made: ``8 P T`` per recomputed
    block (forward, recompute, backward), ``6 P T`` per stashed one (no recompute), over
    ``flops`` and the compute spans' seconds; stashing half the blocks at the same span time
    is a lower rate by ``(4 * 8 - 2 * 2) / (4 * 8)`` (4 blocks of ``P = 1000``, 2 stashed)."""
    compare = _compare_module()
    args = compare._parser().parse_args(["--layers", "4", "--seq-len", "16", "--micro-batch", "2"])
    hardware = {"flops": 1e9, "block_efficiency": 0.5}
    rates = []
    for stashed in (0, 2):
        result = {"trace_split": {"compute": 0.5}, "block_params": 4000, "stashed_blocks": stashed}
        compare._add_block_rate_in_run(result, args, hardware)
        flops = (8 * 1000 * (4 - stashed) + 6 * 1000 * stashed) * 32
        assert result["block_efficiency_in_run"] == pytest.approx(flops / 1e9 / 0.5)
        assert result["block_efficiency_probe_over_run"] == pytest.approx(0.5 / result["block_efficiency_in_run"])
        rates.append(result["block_efficiency_in_run"])
    assert rates[1] / rates[0] == pytest.approx((4 * 8 - 2 * 2) / (4 * 8))
