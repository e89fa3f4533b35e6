"""The embedded default: a tiny model and tokenizer built from scratch, the synthetic arithmetic
tasks and their scorer, so ``make demo`` and the tests need no model hub.

May import ``rlhf_core.data`` and everything below it (it uses ``common`` alone).
"""
