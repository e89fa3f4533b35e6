"""Rollout: generation engines (transformers, the static-cache engine, vLLM), environments and the
tool task, rejection sampling and evaluation.

May import ``rlhf_core.rewards`` and everything below it; the one package that imports vLLM.
"""
