"""The `specgate` command: the gateway and the tools a user runs around it, under one name."""
