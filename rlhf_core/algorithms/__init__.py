"""Pure algorithm math: advantage and KL estimators, policy objectives, preference and KTO losses,
sequence log-probabilities. Plain tensor functions with shapes and paper references; no Ray,
DeepSpeed, vLLM, Prefect or MLflow.

May import ``rlhf_core.models`` (the LM head's log-probabilities) and everything below it (``config`` for the
closed choices), and never Ray, DeepSpeed, vLLM, Prefect or MLflow, not even through another package.
"""
