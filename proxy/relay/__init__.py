"""Relaying a response: its bytes passed through in whole events, watched, stored, and shadowed."""
