"""Promotion guards: the checks a trained model must pass before it is registered, the probe that
measures them and the user's metric command.

May import ``rlhf_core.rollout`` and everything below it, not ``rlhf_core.tracking`` (the same level).
"""
