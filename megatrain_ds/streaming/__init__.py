"""Running the model from streamed weights: forward with checkpoints, backward with recompute.

- ``weight_streamer``: blocks' weights host-to-device into a pool of device slots, ahead of use.
- ``weight_fragments``: a block's weights in pieces, each with its event (``"fragment_bytes"``).
- ``activation_offload``: activation checkpoints parked in host memory between the passes.
- ``activation_stash``: a stashed block's saved activations in host memory between its
  forward and its backward (``"recompute"``), so its backward need not recompute.
- ``streamed_blocks``: each block's forward redirected to the engine; recompute and
  gradients in backward.
- ``tiled_mlp``: a block's token-wise MLP over sequence tiles, recomputed tile by tile.
- ``resident_params``: the non-block parameters (embeddings, final norm, lm_head), kept
  on the device and refreshed after every step.

May import: ``config``, ``runtime``, ``state``, ``gradients``, ``distributed``,
``optimizer``, ``model``.
"""
