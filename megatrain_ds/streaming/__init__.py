"""Running the model from streamed weights: forward with checkpoints, backward with recompute.

- ``weight_streamer``: blocks' weights host-to-device into a pool of device slots, ahead of use.
- ``activation_offload``: activation checkpoints parked in host memory between the passes.
- ``streamed_blocks``: each block's forward redirected to the engine; recompute and
  gradients in backward.
- ``tiled_mlp``: a block's token-wise MLP over sequence tiles, recomputed tile by tile.
- ``resident_params``: the non-block parameters (embeddings, final norm, lm_head), kept
  on the device and refreshed after every step.

May import: ``config``, ``runtime``, ``state``, ``gradients``, ``distributed``,
``optimizer``, ``model``.
"""
