"""A fleet of engines: `engines.py` follows each endpoint of a fleet file, `content.py` names a
block by its tokens' chain, `index.py` is the prefix cache across the fleet by content, `load.py`
the chat workload and its routing policies, `refreshed.py` a value too slow for the page's
thread, kept fresh."""
