"""The user's model as the engine sees it: its repeated blocks, their templates, its batches.

- ``block_discovery``: finds the repeated transformer blocks.
- ``block_template``: one weightless module per distinct block structure, weights bound as views.
- ``batch_checks``: clear errors for batches the model cannot take.
- ``layer_checkpointing``: the model's own gradient checkpointing, switched off inside streamed blocks.
- ``chunked_loss``: projection + cross-entropy over sequence chunks, no ``tokens x vocab`` logits.
- ``causal_lm_loss``: a Hugging Face causal LM's labelled loss computed with it.
- ``frozen_weights``: frozen weights cast to the compute dtype (``"frozen_weights": "compute_dtype"``).

May import: ``config``, ``runtime``, ``state``.
"""
