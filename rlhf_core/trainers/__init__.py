"""Trainers: one readable file per algorithm (none imports another), sharing the loop pieces: ``step.py`` (one optimizer step), ``batches.py`` (examples to
micro-batches), ``loop.py`` (the checkpointed loop), ``offline.py`` (the offline trainers' loop body);
online RL's roles in ``rl_roles.py`` and ``rl_forward.py``; the one Ray boundary in ``ray_launcher.py``, with
online RL's controller over actor groups (``rl_on_ray.py``) and the rollout role (``rollout_replica.py``).

May import ``rlhf_core.promotion``, ``rlhf_core.tracking`` and everything below them; the one package that
imports Ray.
"""
