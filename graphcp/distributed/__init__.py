"""Distributed runtime: topology (rank map) and the collectives the forward uses."""
