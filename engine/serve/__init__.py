"""The engine on the wire: the WebSocket server and hub, the replay of a recording, the
Prometheus metrics and the shared command line."""
