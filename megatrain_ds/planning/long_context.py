"""Long context: the chunked loss's and the tiled MLP's sizes, and memory per token.

At long context a step's memory beyond the persistent state grows with the tokens ``T``:

- activation checkpoints, ``T x hidden`` per segment (on the host when offloaded);
- one block's recompute: its activations (``ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN``
  bytes per token per hidden unit in 16-bit; SDPA attention holds no ``T x T`` matrix)
  and, for the MLP, ``T x FFN`` intermediates -- or only a tile's
  (``streaming/tiled_mlp.py``);
- the head: the logits, their fp32 copy, softmax and gradient, ``T x vocab`` each -- or
  only a chunk's (``model/chunked_loss.py``), plus the hidden-state gradient
  (``T x hidden``) and the ``vocab x hidden`` fp32 weight-gradient accumulator.

The sizes of the tiles and chunks are chosen here (``"auto"``) so that each tile's or
chunk's transients take at most :data:`TILE_BUDGET_FRACTION` of the memory free for
compute, and at most :data:`MAX_TILE_BYTES`: large enough to keep the matmuls efficient,
small enough to leave the block and the head everything else.
"""

from __future__ import annotations

from torch import nn

from megatrain_ds.streaming.tiled_mlp import TOKEN_WISE_NAMES

# The share of the free device memory one tile's or chunk's transients may take, and a
# cap (beyond it, larger tiles do not make the matmuls faster).
TILE_BUDGET_FRACTION = 1 / 16
MAX_TILE_BYTES = 256 << 20
MIN_TILE_TOKENS = 256
TILE_ALIGN = 128

# Per token of a loss chunk, bytes per vocabulary entry: the logits in the compute dtype
# (``w``), their fp32 copy, cross-entropy's log-softmax and the fp32 gradient.
LOSS_FP32_COPIES = 3
# Per token of an MLP tile, values per FFN unit held at once: gate and up projections,
# the activation and the product (the recompute of a tile keeps them for its backward).
MLP_INTERMEDIATES = 4


def _tokens_for(budget_bytes: int, bytes_per_token: int) -> int:
    tokens = budget_bytes // max(bytes_per_token, 1)
    return max(MIN_TILE_TOKENS, tokens // TILE_ALIGN * TILE_ALIGN)


def _budget(free_bytes: int) -> int:
    return min(int(free_bytes * TILE_BUDGET_FRACTION), MAX_TILE_BYTES)


def loss_chunk_bytes_per_token(vocab: int, compute_bytes: int) -> int:
    """Transient bytes of the chunked loss per token of a chunk."""
    return vocab * (compute_bytes + 4 * LOSS_FP32_COPIES)


def mlp_tile_bytes_per_token(ffn: int, compute_bytes: int) -> int:
    """Transient bytes of a tiled MLP per token of a tile."""
    return ffn * compute_bytes * MLP_INTERMEDIATES


def choose_loss_chunk_tokens(vocab: int, compute_bytes: int, free_bytes: int) -> int:
    """``"loss_chunk_tokens": "auto"``: tokens per chunk of the loss."""
    return _tokens_for(_budget(free_bytes), loss_chunk_bytes_per_token(vocab, compute_bytes))


def choose_mlp_tile_tokens(ffn: int, compute_bytes: int, free_bytes: int) -> int:
    """``"mlp_tile_tokens": "auto"``: tokens per tile of a block's MLP."""
    return _tokens_for(_budget(free_bytes), mlp_tile_bytes_per_token(ffn, compute_bytes))


def ffn_width(block: nn.Module) -> int:
    """The widest intermediate of ``block``'s token-wise MLP (0 without one): the largest
    dimension of its weight matrices (for stacked experts, of one expert's)."""
    widths = [
        max(param.shape[-2:])
        for name in TOKEN_WISE_NAMES
        if isinstance(getattr(block, name, None), nn.Module)
        for param in getattr(block, name).parameters()
        if param.dim() >= 2
    ]
    return max(widths, default=0)
