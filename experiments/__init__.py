"""Experiments that reproduce (and extend) the paper's evaluation; run with `python -m experiments.run`."""
