"""Prompts the server tests share."""
from __future__ import annotations


SYSTEM = "You are KVScope's demo assistant. Answer in one short sentence, politely. " * 2
