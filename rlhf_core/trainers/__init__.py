"""Trainers: one readable file per algorithm, sharing the loop pieces in ``loop.py``."""
