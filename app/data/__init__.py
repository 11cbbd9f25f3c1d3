"""The dashboard's data layer: sources, the client, the history and its stores, the mirror,
followers and presets. Never imports streamlit (tests/unit/test_layout.py)."""
