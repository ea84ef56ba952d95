"""The offline path: ``tightpack pack`` in Python, from rows to a published folder of packs.

- `pipeline`: `pack_dataset`, the run end to end, and `tokenize_inputs` (``tightpack plan``);
- `config`: `PackConfig`, the settings of a run, checked before any work;
- `accounting`: which tokenized samples a run keeps, and the counts of the manifest;
- `store_reuse`: the token store taken from the cache or added to it;
- `output`: the packs and the manifest written into the run's staging folder;
- `output_folder` (and `output_lock`): one run per output folder, the folder published atomically;
- `pack_flags`: the ``tightpack pack`` flag of every setting a manifest records;
- `engines`: where the tokenizing and the writing run (`engines.local`, `engines.ray`), behind one
  interface (`engines.base.Engine`).

`PackConfig`, `PackResult` and `pack_dataset` are imported from here (or from ``tightpack``) when first
asked for: the pipeline loads the tokenizers and pyarrow.
"""

from __future__ import annotations

__all__ = ["PackConfig", "PackResult", "pack_dataset"]


def __getattr__(name: str):
    if name in __all__:
        from tightpack.offline import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'tightpack.offline' has no attribute {name!r}")
