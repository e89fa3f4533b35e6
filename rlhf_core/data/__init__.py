"""Data layer: readers with file/line provenance, the Great Expectations gate, tokenization.

May import ``rlhf_core.config`` (the dataset field names and limits) and ``rlhf_core.common``.
"""
