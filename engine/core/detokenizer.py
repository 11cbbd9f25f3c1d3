"""Incremental detokenization: the new text of each sampled token, never a half character."""
from __future__ import annotations

from dataclasses import dataclass

LOOKBACK_TOKENS = 6  # prompt tokens decoded along with the first output, so merges across the boundary show


@dataclass
class Detokenizer:
    prefix_offset: int = 0  # decode from here, so merges with earlier tokens are seen
    read_offset: int = 0    # text up to here has been emitted

    @classmethod
    def after_prompt(cls, num_prompt_tokens: int) -> Detokenizer:
        return cls(max(0, num_prompt_tokens - LOOKBACK_TOKENS), num_prompt_tokens)

    def step(self, tokenizer, ids: list[int]) -> str:
        """Text added by `ids[read_offset:]`; empty while it ends in an incomplete character."""
        prefix = tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = tokenizer.decode(ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return full[len(prefix):]
