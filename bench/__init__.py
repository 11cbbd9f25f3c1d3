import engine  # noqa: F401  (before any torch import: the engine's OpenMP wait policy)
