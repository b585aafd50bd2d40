"""Names chosen outside a `PNMixConfig` that the method itself reads: which implementation runs, and
the layer kinds it serves.

The one home of this tuple. This module imports nothing, so that the storage layer and the service
check these names without loading torch (`pnmix.backend` imports it). The tuner's names (methods,
budget kinds) are in `pnmix.storage.vocabulary`.

BACKENDS: which implementation runs the decode path (`pnmix.backend`, `PNMIX_BACKEND`): `auto`
          picks the Triton kernels for CUDA tensors and the torch reference elsewhere.
"""

BACKENDS = ("auto", "torch", "triton")

# The layer kinds PN-Mix serves (transformers' `layer_types` names; pnmix.families reads them).
FULL, SLIDING = "full_attention", "sliding_attention"
