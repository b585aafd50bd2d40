"""The axes of the search space: the values a searched knob takes (tuner/search/space.py)."""

RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # salient ratios of a mixed bit pair
SINKS = (0, 8, 16, 32, 64)  # attention-sink tokens kept in full precision
VALUE_BITS = (1, 2, 4, 8)  # searched value bits (`search_values`)
VALUE_GROUPS = (32, 64, 128)  # searched value group sizes, those that divide the model's head_dim
