"""Training state: where every parameter lives and the buffers that hold it.

- ``flat_layout``: where each parameter of a block lies in the block's one flat buffer.
- ``placement``: where each buffer of each flat state lives (host, node span, a rank's
  window on the NVMe tier, gathered) and its size, computed once; what the engine's
  builders, ``host_bytes()``, preflight, the planner, ``state_dict``, save and load read.
- ``host_store``: the flat fp32 master, Adam moments, compute shadow and gradient
  accumulator of one block (or of the resident parameters).
- ``nvme_tier``: the NVMe tier: blocks' Adam moments (and masters) in swap files, moved
  through a bounded window in host memory, read ahead and written behind.
- ``frozen_files``: with the weights on the tier (one process), each block's frozen weights
  in a read-only file of their own, in their dtype, written once.
- ``residency``: where the optimizer asks for a state's optimizer state (host memory, or
  the tier).
- ``nvme_weights``: the weight window: with the weights on the tier, blocks' weights read
  from the swap files ahead of forward and backward for the weight streamer.
- ``swap_io``: O_DIRECT reads and writes of swap files (DeepSpeed's async I/O op, or a
  thread pool) and the disk's own bandwidth.
- ``swap_directory``: one locked directory of preallocated swap files per run.

May import: ``config``, ``runtime``.
"""
