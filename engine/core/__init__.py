"""The engine without a model: sequences, the block manager, the scheduler, the event log
and the step loop (EngineCore)."""
