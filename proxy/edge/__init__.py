"""The client side: sockets and their limits, who may ask, what may be asked, the request checked."""
