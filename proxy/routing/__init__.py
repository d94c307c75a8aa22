"""Where a request goes: the router, the decision's steps, leases, tokens, classes and affinity."""
