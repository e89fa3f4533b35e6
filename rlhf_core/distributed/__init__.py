"""Distributed execution below the trainers: data parallelism over torch.distributed (with or
without DeepSpeed) and weight synchronisation from the learner to the rollout replicas.

May import ``rlhf_core.models`` and ``rlhf_core.common``.
"""
