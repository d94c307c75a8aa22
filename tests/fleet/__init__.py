"""What servers and engines say: adapters, readings, the calibration file."""
