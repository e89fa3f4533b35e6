"""Trainers: one readable file per algorithm, sharing the loop pieces in ``loop.py``; none imports another.

May import ``rlhf_core.promotion``, ``rlhf_core.tracking`` and everything below them; the one package that
imports Ray (the launcher).
"""
