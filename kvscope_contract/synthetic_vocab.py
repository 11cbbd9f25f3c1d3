"""The synthetic engine's vocabulary (engine/synthetic.py: random tokens for a model): token i is
the word WORDS[i]. Here so that a client (the fleet page's prompt scoring) can tokenize for it
without importing the engine."""

SYLLABLES = ["ka", "lo", "mi", "re", "su", "ta", "no", "vi", "de", "po", "ra", "ne", "ku", "si", "ba", "to"]
VOCAB = 4096
WORDS = [f" {SYLLABLES[i % 16]}{SYLLABLES[(i // 16) % 16]}{SYLLABLES[i // 256]}" for i in range(VOCAB)]
INDEX = {w.strip(): i for i, w in enumerate(WORDS)}
