"""Replicas and workers that behave as one gateway: shared capacity, a shared prefix view."""
