"""The mirror of the engine at any retained event: the history, its store, the mirror, block text, groups, followers."""
