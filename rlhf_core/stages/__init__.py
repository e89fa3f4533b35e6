"""Stages: what runs one stage end to end (gate the inputs, open the run, train, guard, record).

The top of ``rlhf_core``; may import every package below it.
"""
