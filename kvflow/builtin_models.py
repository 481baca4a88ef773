"""The models kvflow runs without a checkpoint (the hash test models): their names and architecture keys.

Invariants: this module imports nothing from kvflow, so both `kvflow.model_info` (which resolves a name to a
`ModelInfo`) and `kvflow.models.registry` (which maps an architecture key to its class) stand above it and neither
needs the other; every name in `HASH_ARCHITECTURES` maps to a distinct architecture key, and no checkpoint may name
one of those keys.
"""

from __future__ import annotations

HASH_MODEL_NAME = "hash"
# The hash model with logits (structured outputs and logits controls apply to it): `HashLogitsModel`.
HASH_LOGITS_MODEL_NAME = "hash-logits"
# The architecture keys of the hash models; `kvflow.models.registry` maps them to model classes.
HASH_MODEL_ARCHITECTURE = "HashModel"
HASH_LOGITS_MODEL_ARCHITECTURE = "HashLogitsModel"
# Model name -> architecture key, for every model without a checkpoint.
HASH_ARCHITECTURES = {
    HASH_MODEL_NAME: HASH_MODEL_ARCHITECTURE,
    HASH_LOGITS_MODEL_NAME: HASH_LOGITS_MODEL_ARCHITECTURE,
}
