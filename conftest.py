"""Collection guards for the doctest run over ``src/tightpack``: optional extras may be missing."""

try:
    import megatron.energon  # noqa: F401
except ImportError:
    collect_ignore = ["src/tightpack/runtime/energon.py"]
