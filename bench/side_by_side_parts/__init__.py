"""The pieces of ``bench/side_by_side.py`` (alignflow and TRL side by side), one concern a module; run them through
that script, whose docstring says what it measures and how.

``settings`` (variants, rows) · ``inputs`` (tokenizer, data, model) · ``measure`` (what every child process records:
logs, threads, peak memory; the ceiling child) · ``profiling`` (sinks, ``--profile``, ``--sync-census``) · ``ours``
and ``trl_side`` (one row of one benchmark in a child) · ``processes`` (a child's entry, the parent's launcher) ·
``summary`` (figures, floors, ratios, targets) · ``results`` (the result file, ``--combine``, ``--scaling``,
``--resummarize``). The modules import each other relatively; the package is importable with bench/ on
``sys.path``, as the script puts it there and as Ray gives it to its workers (the script's folder).
"""
