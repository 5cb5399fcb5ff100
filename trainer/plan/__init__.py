"""Goodput planning: expected goodput per recovery mode and the save periods that maximise it.

`model` holds the pure functions (closed form and Monte Carlo), `costs` measures a run's phase costs
from its run directory, and `__main__` is the command line (`python -m trainer.plan`).
"""
