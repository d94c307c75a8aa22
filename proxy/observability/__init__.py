"""What specgate says of itself: metrics, traces, logs and its own routes."""
