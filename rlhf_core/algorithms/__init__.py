"""Pure algorithm math: ``advantages`` (advantage estimators, DAPO shaping), ``kl`` (KL estimators and
controllers), ``policy`` (policy objectives, value loss), ``masked`` (masked statistics, loss aggregation),
``losses`` (SFT, preference and unpaired-preference losses), ``logprobs`` (sequence log-probabilities); ``rl_math`` re-exports the
first four under one path. Plain tensor functions with shapes and paper references; no Ray,
DeepSpeed, vLLM, Prefect or MLflow.

May import ``rlhf_core.models`` (the LM head's log-probabilities) and everything below it (``config`` for the
closed choices), and never Ray, DeepSpeed, vLLM, Prefect or MLflow, not even through another package.
"""
