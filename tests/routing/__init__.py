"""Where a request goes: the policies, the steps, beliefs, classes, affinity, topologies."""
