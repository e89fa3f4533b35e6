"""The team profile's services on one machine: ``alignflow services up|down|status`` (``make services``).

``up`` starts PostgreSQL (its own data folder and port; :mod:`.postgres`), an S3-compatible object store (moto in
server mode, its own process over HTTP), an MLflow tracking server on PostgreSQL with its artifacts in the object
store, and a Prefect server on PostgreSQL (:mod:`.servers`), each tracked by a pid file (:mod:`.processes`); the
DVC remote lives in the same bucket. Settings: the ``team`` section of ``params.yaml``; credentials:
:mod:`.credentials` (the environment or a file outside the repository). ``--profile team`` points a run at them
(:mod:`flows.profiles`).

May import ``rlhf_core.config`` and ``rlhf_core.common``; never the ML stack (import-linter contract
``services-light``), so the command starts and stops servers in a second. Prefect and MLflow run as servers in
processes of their own; only ``up`` loads Prefect's client, to size the GPU limit.
"""
