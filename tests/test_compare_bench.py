"""``bench/compare.py``'s fairness: every system starts from the same weights.

The harness fills each parameter from a generator seeded by its name, so the weights do
not depend on the order a system builds its modules in, nor on the global RNG (DeepSpeed's
``zero.Init`` builds partitioned modules on which Hugging Face's own init never runs). Its
end-to-end check (every system's first loss side by side) runs with the bench itself.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
