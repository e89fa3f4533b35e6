"""Data layer: readers with file/line provenance, the Great Expectations gate, tokenization."""
