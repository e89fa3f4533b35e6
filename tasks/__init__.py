"""Prefect tasks: small, typed, verb-named wrappers of ``rlhf_core.stages.wrappers``.

Tasks take and return paths, md5s and config dicts (never tensors or models), retry where
failures are transient (never on bad data or bad config), and cache on their inputs — the
md5s of input files, the stage's params — plus their own source code, the source of the
training core (``rlhf_core``) and the alignflow version.
"""
