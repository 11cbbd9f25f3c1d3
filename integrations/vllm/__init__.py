"""KVScope inside vLLM: the plugin (plugin.py) and its backend (backend.py), the observer of vLLM's
pool (observer.py), the launcher (serve.py). Importable without vLLM: what its tests share."""

SNAPSHOT_INTERVAL_S = 0.2  # the plugin takes a snapshot of vLLM's pool at most this often, for every client waiting
# new connections to the plugin: a room's dashboards at once, then a reconnect loop slowed to 2 a
# second (engine/serve/admission.py: each costs vLLM's process a handshake, a hello and a snapshot)
ADMIT_BURST, ADMIT_PER_S = 8, 2.0
