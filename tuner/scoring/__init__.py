"""The scoring wing: what one config scores on one model, by real inference.

It knows configs, models and tasks, and nothing of campaigns: the search wing (tuner/search/)
imports it, never the other way. docs/design.md maps its modules.
"""
