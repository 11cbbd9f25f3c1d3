"""A sequence: the tokens of one sample of a request, and where their KV lives."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvscope_contract.protocol import DEFAULT_MAX_TOKENS
from kvscope_contract.state import GroupTables
from engine.core.detokenizer import Detokenizer


class SeqStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(eq=False)
class Sequence(GroupTables):
    seq_id: str
    request_id: str
    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_prompt_tokens: int = -1
    status: SeqStatus = SeqStatus.WAITING
    # one table per KV-cache group (the BlockManager sizes them); NULL_BLOCK where a sliding
    # window has passed a block or a prefix hit skipped it
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    host_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_computed_tokens: int = 0   # tokens whose K/V the cache holds
    num_registered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of full blocks (memo)
    arrival: int = 0  # admission order: the latest arrival is preempted first
    text: str = ""    # decoded output so far
    detokenizer: Detokenizer | None = None
    generator: object = None  # a seeded torch.Generator, or None for the global one
    # what names a full block's content where its token ids do not (a trace replay's hash ids,
    # engine/lab/trace_replay.py): `content(i, block_size)` -> a tuple, or None for the tokens
    content: object = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)


    def block_tokens(self, i: int, block_size: int) -> tuple[int, ...] | list[int]:
        """What the prefix cache keys and compares full block i by: its token ids, unless
        `content` names the block otherwise."""
        if self.content is not None and (key := self.content(i, block_size)) is not None:
            return key
        return self.token_ids[i * block_size:(i + 1) * block_size]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]
