"""Models and their kernels: loading, precision, attention (training and decode), the LM head
(fused and chunked log-probabilities) and compiled decoder layers.

May import ``rlhf_core.embedded`` and everything below it (``data`` for chat templates).
"""
