"""The search wing: Optuna campaigns over configs, their trials, fronts and recommendations.

It asks the scoring wing (tuner/scoring/) for scores through its `Scorer` protocol and keeps what
it learns in Optuna studies and the product's database. docs/design.md maps its modules.
"""
