"""The static engine's decode step (:mod:`rlhf_core.rollout.static` runs it): the decoder with its static KV cache
(:mod:`.decoder`), the layer math it compiles (:mod:`.layer`), the decode attention over the cache (:mod:`.attention`),
sampling on the device (:mod:`.sampling`) and the switches benchmarks A/B (:mod:`.settings`).

May import ``rlhf_core.models`` and ``rlhf_core.rollout.engine`` (sampling parameters); nothing here imports the
engine in :mod:`rlhf_core.rollout.static`.
"""
