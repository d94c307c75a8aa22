"""`python -m loadtest ablation`: each routing mechanism against the same stack with it off, side by
side, on a protocol fixed before the runs (cli.py states it).

protocol: the mechanisms, their switches, the cells, seeds and window, and the plan built from them;
run: the processes and the load; score: the pure scoring and verdicts; report: the tables.
"""
