"""Experiments: plain functions returning {"title", "rows", "summary", "plots"}; bound by gin in the CLI.

Each returns rows (one dict per table line), a summary dict, and declarative plot specs that the runner
renders (see ``specjax.runner.make_plot``).
"""
from experiments.quickstart import quickstart

EXPERIMENTS = {"quickstart": quickstart}
