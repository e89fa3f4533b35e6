"""Models and their kernels: loading, importing (a pretrained model from a package's GGUF file or a folder),
precision, attention (training and decode), the LM head (fused and chunked log-probabilities) and compiled
decoder layers.

May import ``rlhf_core.embedded`` and everything below it (``data`` for chat templates).
"""
