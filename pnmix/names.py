"""Names chosen outside a `PNMixConfig`: which method a campaign tunes, which implementation runs.

The one home of each tuple. This module imports nothing, so that the storage layer and the
service check these names without loading torch (`pnmix.backend` imports it).

METHODS:  the methods a campaign tunes and compares on one model, each a restriction of the
          config's knobs (`tuner.space` gives each its search space): PN-Mix itself, KIVI
          (uniform key bits, no salient channels, no sinks) and a Kitty-like method (4/2 bits on
          high-magnitude channels), plus the layer-wise ones: `pnmix-alloc` (the default), where
          every layer takes its own b_high, b_low and salient ratio from the allocator
          (`tuner.layers`: per-layer sensitivity and a knapsack under the budget, then local moves
          scored by real accuracy), and `pnmix-layers`: groups of layers (formed by layer
          sensitivity) that each take their own pair and ratio as sampled trial parameters.
BUDGET_ON: the bit figure a campaign's budgets constrain (`pnmix.bits`): key bits per key element,
          or KV bits, keys and values together per cached element.
BACKENDS: which implementation runs the decode path (`pnmix.backend`, `PNMIX_BACKEND`): `auto`
          picks the Triton kernels for CUDA tensors and the torch reference elsewhere.
"""

METHODS = ("pnmix-alloc", "pnmix", "kivi", "kitty", "pnmix-layers")
DEFAULT_METHOD = "pnmix-alloc"
BUDGET_ON = ("key", "kv")
BACKENDS = ("auto", "torch", "triton")
