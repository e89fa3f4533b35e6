"""Trainers: one readable file per algorithm, sharing the loop pieces: ``step.py`` (one optimizer step),
``batches.py`` (examples to micro-batches), ``loop.py`` (the checkpointed loop), ``offline.py`` (the offline
trainers' loop body)."""
