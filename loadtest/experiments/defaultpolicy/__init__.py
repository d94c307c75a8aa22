"""`defaultpolicy`: the default policy measured. Uncalibrated `adaptive` and uncalibrated `threshold`
against calibrated `threshold` at every level of calibrate's grid, on two simulated pairs, side by
side on the same simulators; the protocol is cli.py's docstring (the command's --help)."""
