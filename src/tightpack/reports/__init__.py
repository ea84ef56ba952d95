"""What the read-only commands print and draw: ``tightpack inspect``, ``tightpack plan``, their plots.

- `summary`: ``tightpack inspect``; a packed dataset on disk read into per-pack arrays and summarized.
- `pack_sizes`: ``tightpack plan``; every candidate pack size planned on one tokenization.
- `pack_size_rows`: the rows of ``tightpack plan``, its table and its recommendation.
- `plots`: ``--plot`` and ``--html`` of both commands (matplotlib, the ``plots`` extra).

Nothing is imported here: each command imports the module it needs (`plots` only when a figure is made).
"""
