"""The model side of the engine: loading, the paged forward, sampling, detokenizing, and
LLMEngine, which joins them to the core."""
