"""Process-level helpers every layer may use: atomic file writes, secret redaction, offline switches,
log quieting, bounded HTTP reads, time limits, short value rendering and the project folder.

Imports nothing else from ``rlhf_core``; the standard library and small dependencies only.
"""
