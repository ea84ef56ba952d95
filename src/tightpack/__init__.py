"""tightpack: sequence packing for LLM and VLM fine-tuning.

The package root exports the planner and the offline pipeline. The supported API is what the docs' API
reference (docs/reference/) shows; every other module is internal.
"""

from tightpack.core.alignment import alignment_multiple
from tightpack.core.cost_model import CostModel
from tightpack.core.planner import ALGORITHMS, PackPlan, plan_packs
from tightpack.core.stats import PackStats, pack_stats
from tightpack.errors import TightpackError

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "CostModel",
    "PackConfig",
    "PackPlan",
    "PackResult",
    "PackStats",
    "TightpackError",
    "__version__",
    "alignment_multiple",
    "from_hf_packed",
    "pack_dataset",
    "pack_stats",
    "plan_packs",
    "to_hf_dataset",
]
assert __all__ == sorted(__all__)


def __getattr__(name: str):
    # The pipeline pulls in tokenizers and pyarrow; import it only when asked for.
    if name in ("PackConfig", "PackResult", "pack_dataset"):
        from tightpack.offline import pipeline

        return getattr(pipeline, name)
    if name in ("from_hf_packed", "to_hf_dataset"):
        from tightpack import hf_datasets

        return getattr(hf_datasets, name)
    raise AttributeError(f"module 'tightpack' has no attribute {name!r}")
