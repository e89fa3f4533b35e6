"""The typed configuration of every stage (one dataclass per stage, validated on construction).

May import ``rlhf_core.common`` and ``rlhf_core.data`` (the reader's byte limit); the closed choices
of the algorithm modules are checked where the stage config is validated.
"""
