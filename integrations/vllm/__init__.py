"""KVScope inside vLLM: the plugin (plugin.py) and its backend (backend.py), the observer of vLLM's
pool (observer.py), the launcher (serve.py). Importable without vLLM: what its tests share."""

SNAPSHOT_INTERVAL_S = 0.2  # the plugin takes a snapshot of vLLM's pool at most this often, for every client waiting
