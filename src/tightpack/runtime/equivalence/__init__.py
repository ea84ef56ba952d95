"""Proof that packing is exact on the user's own model: the equivalence probe and the static refusals.

- `tightpack.runtime.equivalence.probe`: the probe's rows, five forward passes, figures and rule.
- `tightpack.runtime.equivalence.hf`: the probe on a Hugging Face model (``Trainer`` inputs or THD
  batches), `check_packing`.
- `tightpack.runtime.equivalence.leak_layers`: the decoder layer where a leak enters.
- `tightpack.runtime.equivalence.megatron`: the probe on a Megatron-Core forward with `PackedSeqParams`.
- `tightpack.runtime.equivalence.architectures`: model families the installed transformers cannot run
  packed, refused before any step.
"""

from tightpack.runtime.equivalence.architectures import check_architecture, unpackable_reason  # noqa: F401 (for the package's own modules; not public API)
from tightpack.runtime.equivalence.hf import check_packing, probe_batch, probe_enabled, probe_model_inputs  # noqa: F401 (for the package's own modules; not public API)
from tightpack.runtime.equivalence.megatron import check_mcore_packing
from tightpack.runtime.equivalence.probe import (  # noqa: F401 (for the package's own modules; not public API)
    GAP_FRACTION,
    LEAK_FRACTION,
    PackingLeakError,
    ProbeReport,
    ProbeSkipped,
    run_probe,
)

__all__ = ["PackingLeakError", "ProbeReport", "check_mcore_packing", "check_packing"]
