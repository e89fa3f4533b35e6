"""The typed configuration of every stage (one dataclass per stage, validated on construction).

May import ``rlhf_core.common`` only, and nothing that needs torch: the CLI reads and checks configs
without the ML stack. The closed choices (estimators, reward kinds, ...) are declared here, in ``choices``.
"""
