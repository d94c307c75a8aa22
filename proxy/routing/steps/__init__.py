"""The steps of a new request's placement, in order (pipeline.py): each sees the request and a
read-only view of its group, and gives a decision with its reason or passes. Pure."""
