"""`python -m loadtest headtohead-classes`: two traffic classes on a shared-GPU pair or a pool, every
target a fresh stack of its own (cli.py describes the protocol). An experiment's harness on the kit.

plan: the targets, classes and settings; score: one run's figures and verdicts, pure; pooled: the
verdicts over repeated runs; run: the calibration, the stacks and the cells; report: the table and
the summary.
"""
