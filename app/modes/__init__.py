"""The dashboard's pages beyond Explore: Lessons (with their TOML scripts), the Lab and a
ZMQ KV-event source."""
