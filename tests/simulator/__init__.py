"""The simulated engine: its wire, physics, speed and cache."""
