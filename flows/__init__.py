"""Prefect flows (they only sequence tasks) and the ``alignflow`` command line."""
