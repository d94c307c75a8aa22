"""The pure policies and what they believe: the mode rules, the speed models, evidence, calibration."""
