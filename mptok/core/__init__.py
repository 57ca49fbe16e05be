"""The bottom layer: what every other layer shares; nothing here imports another mptok layer."""
