"""One-off experiment harnesses, apart from the commands a user runs: each measured one question once
(a mechanism against its alternatives, on a protocol of its own) and is kept so that its results can
be run again. They are built on the same kit as the product's commands (`loadtest.kit`) and are
reached as subcommands of `python -m loadtest` all the same.

- `twoclass`: `headtohead-classes`, two traffic classes on a shared-GPU pair or a pool (issue 28);
- `affinityrule`: `headtohead-affinity`, cache affinity's rule among a role's servers;
- `defaultpolicy`: `defaultpolicy`, the policies without a calibration file against calibrated threshold.
"""
