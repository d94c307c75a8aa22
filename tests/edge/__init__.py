"""The client side: sockets, limits, bad input, logs."""
