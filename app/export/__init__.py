"""A recording for other tools: perfetto.py writes it as a Perfetto trace (kvscope-export)."""
