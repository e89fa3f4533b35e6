"""Stages: what runs one stage end to end, and the registry that declares each stage once.

``registry`` (each stage's command, config, entry, datasets, DVC stages; imports nothing of the core),
``wrappers`` (each stage's entry function; a training stage as the pipeline gate the inputs -> open the run
-> train -> guards -> register), ``gate`` (the inputs' validation and data report) and ``guard`` (a policy
stage's guards against its parent).

The top of ``rlhf_core``; may import every package below it.
"""
