"""Packed (padding-free) batches: several sequences in one row, longer than the model's positions.

TRL's ``packing=True`` and padding-free collators concatenate sequences in a row and give
``position_ids`` restarting at 0 for each ([Note: packed rows] in
``megatrain_ds/model/batch_checks.py``). The engine must train them exactly as plain
PyTorch does (parity, tolerances of ``test_parity.py``), judge their length by the
positions and not the row, and still reject positions the model does not have.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import tiny_models
import torch
import trl
from packaging.version import Version
from side_by_side import ds_config, train_side_by_side
from test_parity import assert_parity
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from megatrain_ds import MegatrainEngine, parse_engine_config

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

# Rows of 100 tokens, each packing sequences of at most 64 tokens (the tiny models' positions).
PACKS = [[40, 30, 30], [64, 36]]

TRL_GIVES_VARLEN_KEYWORDS = Version(trl.__version__) >= Version("1.16.0")
"""TRL's padding-free collator adds ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx``
from 1.16.0 (checked in the wheels of 1.15.0 and 1.16.0); below it hands ``position_ids`` alone."""


def _sequences(seed: int, lengths: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, tiny_models.VOCAB, (n,), generator=generator) for n in lengths]


def hand_packed_batch(seed: int, packs: list[list[int]] = PACKS) -> dict[str, torch.Tensor]:
    """Each row the concatenation of ``packs[row]``'s sequences; labels ignore the first token
    of each sequence (it is not predicted from the previous one), as TRL's collator does.
    ``use_cache=False`` as TRL's ``compute_loss`` passes: with a cache Hugging Face builds a
    plain causal mask and the packed sequences would attend to each other."""
    rows = [_sequences(seed * 10 + row, lengths) for row, lengths in enumerate(packs)]
    input_ids = torch.stack([torch.cat(row) for row in rows])
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in packs])
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "labels": input_ids.masked_fill(position_ids == 0, -100),
        "use_cache": False,
    }


def trl_packed_batch(seed: int) -> dict[str, Any]:
    """What TRL's padding-free collator (``SFTTrainer(packing=True)``'s default) hands the
    model: one row, ``position_ids``, and from TRL 1.16.0 ``cu_seq_lens_q/k``, ``max_length_q/k``
    and ``seq_idx`` (``TRL_GIVES_VARLEN_KEYWORDS``)."""
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    batch = collator([{"input_ids": seq.tolist()} for seq in _sequences(seed, [50, 64, 23, 41])])
    return {**batch, "use_cache": False}  # as SFTTrainer.compute_loss adds


def _separate_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """The packed batch's loss computed sequence by sequence: the mean over every predicted
    token, each sequence run alone."""
    total, count = 0.0, 0
    for ids, positions in zip(batch["input_ids"], batch["position_ids"]):
        starts = [*(positions == 0).nonzero().flatten().tolist(), len(ids)]
        for start, end in zip(starts, starts[1:]):
            seq = ids[start:end][None]
            total += float(model(input_ids=seq, labels=seq).loss) * (end - start - 1)
            count += end - start - 1
    return total / count


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_hand_packed_batch_matches_plain_pytorch(family) -> None:
    """Rotary (Llama, Qwen2 with tied embeddings) and learned positions (GPT-2, dropout on)."""
    engine, reference, trace = train_side_by_side(
        tiny_models.FAMILIES[family], ds_config(), steps=3, make_batch=hand_packed_batch
    )
    try:
        assert_parity(engine, reference, trace)
        # The packing is real: each sequence attends only to itself (the row is longer
        # than the position table, so a row-length reading would have been an error).
        reference.eval()
        engine.eval()
        with torch.no_grad():
            batch = hand_packed_batch(7)
            packed = float(engine(**batch).loss)
            assert math.isclose(packed, _separate_loss(reference, batch), rel_tol=1e-5)
    finally:
        engine.destroy()


def test_trl_padding_free_collator_output_matches_plain_pytorch() -> None:
    batch = trl_packed_batch(0)
    assert batch["input_ids"].shape == (1, 178) and "position_ids" in batch and "attention_mask" not in batch
    assert ("cu_seq_lens_q" in batch) == TRL_GIVES_VARLEN_KEYWORDS
    config = {**ds_config(accumulation=2), "train_micro_batch_size_per_gpu": 1}
    engine, reference, trace = train_side_by_side(tiny_models.llama, config, steps=2, make_batch=trl_packed_batch)
    try:
        assert_parity(engine, reference, trace)
    finally:
        engine.destroy()


@pytest.fixture()
def engine():
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(num_layers=2), parse_engine_config(ds_config()))
    yield engine
    engine.destroy()


def test_packed_positions_past_the_models_are_rejected(engine) -> None:
    batch = hand_packed_batch(0, packs=[[30, 70], [50, 50]])
    with pytest.raises(
        ValueError,
        match=r"packs sequences needing 70 positions \(the largest position_ids \+ 1\), "
        r"more than the 64 positions the model has",
    ):
        engine(**batch)


def test_varlen_keywords_alone_judge_the_length(engine) -> None:
    """Without ``position_ids`` the flash-attention varlen keywords say how a row is split."""
    ids = torch.randint(0, tiny_models.VOCAB, (1, 100))
    fits = torch.tensor([0, 60, 100], dtype=torch.int32)
    too_long = torch.tensor([0, 30, 100], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"needing 70 positions \(the longest sequence of cu_seq_lens"):
        engine(input_ids=ids, cu_seq_lens_q=too_long, cu_seq_lens_k=too_long)
    with pytest.raises(ValueError, match=r"needing 65 positions"):
        engine(input_ids=ids, cu_seq_lens_q=fits, cu_seq_lens_k=fits, max_length_q=65, max_length_k=65)


def test_an_unsplit_long_row_still_names_the_fix(engine) -> None:
    with pytest.raises(
        ValueError,
        match=r"sequences of 100 tokens, more than the 64 positions the model has.*"
        r"pass position_ids restarting at 0",
    ):
        engine(input_ids=torch.randint(0, tiny_models.VOCAB, (2, 100)))
