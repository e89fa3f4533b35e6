"""Distributed execution below the trainers: data parallelism over torch.distributed (with or
without DeepSpeed) and weight synchronisation from the learner to the rollout replicas.

May import ``rlhf_core.algorithms`` and everything below it; the one package that imports DeepSpeed.
"""
