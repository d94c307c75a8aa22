"""Reaching the servers: connections, pools, the headers that cross, and each server's health."""
