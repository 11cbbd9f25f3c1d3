"""The contract between the engine and every consumer of its events: the protocol, the
reducer (PoolState), event kinds, the prefix forest and the lab's report types.
Standard library, msgspec and numpy only: importing it never loads the engine."""
