"""`python -m loadtest field`: the field's setup (smg in front of engines drafting adaptively) beside
specgate's configurations on N simulated H200s (cli.py describes the protocol)."""
