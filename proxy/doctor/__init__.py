"""`specgate doctor`: checks the servers specgate would route to and says what to set."""
