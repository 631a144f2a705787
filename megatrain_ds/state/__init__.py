"""Host-resident training state: where every parameter lives and the buffers that hold it.

- ``flat_layout``: where each parameter of a block lies in the block's one flat buffer.
- ``host_store``: the flat fp32 master, Adam moments, compute shadow and gradient
  accumulator of one block (or of the resident parameters).

May import: ``config``, ``runtime``.
"""
