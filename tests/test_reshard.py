"""``checkpoint/reshard.py``: whole tensors read into a process that holds part of a flat state.

The reference is plain indexing: a part ``[start, end)`` of a whole buffer. The values are
small integers, exact in every dtype used, so equality is exact. The loads that go through
it (several nodes, rank windows, gathered weights) are tested end to end in
``tests/test_data_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_ds.checkpoint.optimizer_spans import HeldSpan
from megatrain_ds.checkpoint.reshard import reshard


def _held(numel: int, start: int, end: int, tensors: dict[str, torch.Tensor]) -> HeldSpan:
    return HeldSpan(numel, start, end, lambda kind: tensors[kind])


def test_the_held_part_of_what_is_read_whole_is_kept() -> None:
    """Two reads into one state's temporary (two parameters of one file) and one into
    another kind: each part gets its elements of the whole, and elements no read wrote
    keep their held value."""
    parts = {"exp_avg": torch.full((4,), -1.0), "exp_avg_sq": torch.full((4,), -2.0)}
    held = _held(10, 3, 7, parts)
    written = torch.arange(10, dtype=torch.float32)
    with reshard() as temporaries:
        whole = temporaries.whole("state", held, "exp_avg")
        assert whole.shape == (10,) and whole.dtype == torch.float32
        assert temporaries.whole("state", held, "exp_avg") is whole  # one temporary per state and kind
        whole[0:5] = written[0:5]  # a parameter at [0, 5)
        whole[5:8] = written[5:8]  # the next, at [5, 8)
        temporaries.whole("state", held, "exp_avg_sq")[8:10] = 7.0  # outside the part only
        assert torch.equal(parts["exp_avg"], torch.full((4,), -1.0))  # kept only at the end
    assert torch.equal(parts["exp_avg"], written[3:7])
    assert torch.equal(parts["exp_avg_sq"], torch.full((4,), -2.0))


def test_outside_values_and_the_whole_copied_on_in_its_dtype() -> None:
    """A sharded master's read: the elements outside the part start as the shadow's, the
    part as the master's, and at the end the master keeps its part and the shadow gets the
    whole, rounded to its dtype."""
    master = torch.tensor([10.0, 11.0], dtype=torch.float32)
    shadow = torch.arange(6, dtype=torch.bfloat16)
    held = _held(6, 2, 4, {"master": master})
    with reshard() as temporaries:
        whole = temporaries.whole(0, held, "master", outside=shadow, whole_into=shadow)
        assert torch.equal(whole, torch.tensor([0.0, 1.0, 10.0, 11.0, 4.0, 5.0]))
        whole[1:3] = torch.tensor([0.5, 2.5])
    assert torch.equal(master, torch.tensor([2.5, 11.0]))
    assert torch.equal(shadow, torch.tensor([0.0, 0.5, 2.5, 11.0, 4.0, 5.0], dtype=torch.bfloat16))


def test_a_failed_read_keeps_nothing() -> None:
    """An error inside the block (a checksum mismatch, say) leaves the held part as it was."""
    part = torch.zeros(2)
    held = _held(4, 1, 3, {"exp_avg": part})
    with pytest.raises(RuntimeError, match="crc"), reshard() as temporaries:
        temporaries.whole("state", held, "exp_avg").fill_(5.0)
        raise RuntimeError("crc")
    assert torch.equal(part, torch.zeros(2))
