"""The dashboard's data layer: sources, the client, the history and its stores, the mirror,
followers and presets, the lessons' model (lessons/) and the fleet's (fleet/). Never imports
streamlit (tests/unit/test_layout.py)."""
