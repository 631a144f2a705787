"""Data parallel on torch.distributed: node-shared host state, sharded
across nodes; gradients reduced per bucket to the ranks that own them.

- ``ownership``: which rank owns which elements of a flat state, which node holds which span.
- ``data_parallel``: who shares memory with whom, and the collectives.
- ``gradient_reducer``: reduces each bucket to the owners of its windows behind backward,
  then hands this rank's window to the gradient sink.

May import: ``config``, ``runtime``, ``state``, ``gradients``.
"""
