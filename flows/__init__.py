"""Prefect flows (they only sequence tasks) and the ``alignflow`` command line; ``services/``: the team profile's
servers (``alignflow services``), ``profiles``: pointing a run at them, ``gpu_limit``: the GPU concurrency limit
every flow run holds around its GPU stages."""
