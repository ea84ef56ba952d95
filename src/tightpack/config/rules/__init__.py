"""The validation rules: one module per part of the packing contract, in the reference's order by `registry`.

- `batching`: run length, loader, batch arithmetic and sequence length, which every dataset kind shares.
- `offline`: offline packing (docs/contract.md §2).
- `collate_time`: collate-time (in-batch) packing (§3).
- `energon`: Energon datasets and native Energon packing (§4).
- `parallel`: context and sequence parallelism, and the loss they need (§6, §7).

`base` defines a rule and how a module registers its rules. docs/validation-rules.md lists every rule; it is
rendered from the registry by ``python -m tightpack.config.rules_table``.
"""

from tightpack.config.rules.registry import ORDER, REGISTRY, RULES  # noqa: F401 (for the package's own modules; not public API)
