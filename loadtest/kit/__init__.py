"""The scenario kit: what every load-testing command is built from.

- `processes`: starting a scenario's simulators and specgates side by side, waiting for them together,
  calibrating a fresh pair first (`loadtest.procs` starts and stops one process);
- `sampling`: the machine's CPU, a server's /metrics (through `proxy.promtext`) and JSON pages;
- `driving`: closed-loop streams, periodic ticks, draining what is in flight at the end;
- `settings`: specgate's environment for a scenario, its time settings scaled to the simulators' clock;
- `plots`: matplotlib, and the strips and shading the timelines share;
- `command`: progress lines, the options and checks a scenario's arguments share, and its tail (the
  report's lines, its plot and its JSON);
- `multiturn`: multi-turn cells on a simulated H200: the sessions' sizes for a mean context, a cell's
  default time scale and its WorkloadSpec;
- `cells`: a cell's targets side by side, each a stack of its own, driven at once with the same
  sessions, and `figures`: one target's figures in a cell, in simulated time;
- `sweeps`: the sweeping commands' (sweep, compare, calibrate, demo) load options and targets swept
  level by level, and `interrupt`: what they print of the levels completed when Ctrl-C stops them.

One target's level (`loadtest.sweep`), its summary and the honest-sampling rule (`loadtest.stats`),
verdicts and tables (`loadtest.report`) and the crossover rule (`loadtest.calibrate`) are the kit's too.
"""
