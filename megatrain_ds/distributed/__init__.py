"""Data parallel on torch.distributed: node-shared host state, one gradient all-reduce per bucket.

- ``data_parallel``: who shares memory with whom, the windows each rank updates, the collectives.
- ``gradient_reducer``: averages each bucket over the ranks behind backward, then hands
  this rank's window to the gradient sink.

May import: ``config``, ``runtime``, ``state``, ``gradients``.
"""
