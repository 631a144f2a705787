"""Checkpoints that are also Hugging Face model directories, and loading weights from them.

- ``tensor_files``: safetensors written from views of host buffers and read back into them.
- ``directories``: crash-safe tag directories, manifests, ``latest``.
- ``save_load``: the engine's ``save_checkpoint``/``load_checkpoint`` (DeepSpeed's API).
- ``safetensors_source``: ``load_from``, parameters filled straight from HF shards.

May import: every room below it: ``config``, ``runtime``, ``state``, ``gradients``,
``distributed``, ``optimizer``, ``model``, ``streaming``.
"""
