"""What the servers are and what their engines say: servers, topology, engine adapters, readings."""
