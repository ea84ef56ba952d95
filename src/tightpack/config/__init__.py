"""A training configuration and its packing validation: every rule of docs/contract.md §5, and the
ones it misses.

`load_config` reads a configuration laid out like Megatron-Bridge's ``ConfigContainer``, from a YAML file or a
dict. `validate` checks it and returns a `ValidationReport` with *every* violation (the reference stops at the
first), each with a rule id, a severity, the reason and the fix, plus the values the reference derives (and
would write into the configuration). docs/validation-rules.md lists the rules.

The modules:

- `schema`: the sections and the dataset kinds, as dataclasses.
- `loading`: a YAML file or a dict to a `RunConfig`; its docstring states which keys are accepted
  without being read and how the dataset kind is chosen. It uses `keys` (what an unknown key means, the
  dataset kind from its fields) and `megatron_bridge` (Megatron-Bridge's sections and fields).
- `derive`: the values the reference derives, and the packing-path predicates.
- `rules`: the rules, one module per part of the contract, and `rules.registry`, their order.
- `validation`: `validate`.
- `report`: `Finding` and `ValidationReport`, as text or JSON-ready data.
- `rules_table`: renders docs/validation-rules.md from the registry.
"""

from tightpack.config.derive import DerivedValues  # noqa: F401 (for the package's own modules; not public API)
from tightpack.config.loading import load_config
from tightpack.config.report import Finding, ValidationReport
from tightpack.config.rules import RULES  # noqa: F401 (for the package's own modules; not public API)
from tightpack.config.schema import (  # noqa: F401 (for the package's own modules; not public API)
    DATASET_TYPES,
    CommOverlapSection,
    DatasetConfig,
    DatasetProvider,
    DDPSection,
    DirectHFSFTDatasetConfig,
    DistSection,
    DistTrainSection,
    EnergonDatasetConfig,
    GPTDatasetConfig,
    GPTSFTDatasetConfig,
    MockVLMSFTDatasetConfig,
    ModelSection,
    PackedSequenceSpecs,
    RunConfig,
    TrainSection,
    ValidationSection,
)
from tightpack.config.schema import renamed as _renamed
from tightpack.config.validation import validate

__all__ = ["Finding", "RunConfig", "ValidationReport", "load_config", "validate"]


def __getattr__(name: str) -> type:
    """The old class names (``TrainingConfig``, ``TrainConfig``, ...), with a DeprecationWarning."""
    return _renamed(__name__, name)
