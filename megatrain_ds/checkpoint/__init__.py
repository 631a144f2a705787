"""Checkpoints that are also Hugging Face model directories, and loading weights from them.

- ``tensor_files``: safetensors written from views of host buffers and read back into them.
- ``directories``: crash-safe tag directories, manifests, ``latest``, names confined to them.
- ``json_tensors``: nested values as JSON plus named tensors (state saved without pickle).
- ``rng_state``: the RNG states of Python, NumPy, the CPU and CUDA, validated before restoring.
- ``trainer_state``: counters, hyperparameters, scheduler, RNG, client_state; old pickles read safely.
- ``checkpointed_engine``: the engine as checkpoints see it: its states in its order, parameters by name, tiers.
- ``reshard``: whole tensors read into a process that holds part of a state (a whole temporary, its part kept).
- ``save``: the engine's ``save_checkpoint`` (DeepSpeed's API): what goes in a tag directory.
- ``load``: the engine's ``load_checkpoint`` (DeepSpeed's API): every file checked, then read in.
- ``optimizer_spans``: each writer's span of the optimizer state (several nodes, rank tiers), read back resharded.
- ``whole_masters``: every parameter's master, wherever it is, for ``state_dict()`` (gathered where needed).
- ``safetensors_source``: ``load_from``, parameters filled straight from HF shards.

May import: every room below it: ``config``, ``runtime``, ``state``, ``gradients``,
``distributed``, ``optimizer``, ``model``, ``streaming``.
"""
