"""Tracking and lineage: MLflow runs, input and code hashes, checkpoints and their manifests,
model cards and plots.

May import ``rlhf_core.promotion`` and everything below it.
"""
