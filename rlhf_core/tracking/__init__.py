"""Tracking and lineage: MLflow runs, input and code hashes, checkpoints and their manifests,
model cards and plots.

May import ``rlhf_core.rollout`` and everything below it, not ``rlhf_core.promotion`` (the same level); the one
package that imports MLflow and Prefect.
"""
