"""A verifiers 0.4 environment with a tool (multi-turn): look a word's secret number up, then say it.

The model calls the ``lookup`` tool (served by verifiers as an MCP server per rollout), reads its result and
answers; the reward is 1 when the reply holds the word's number. Written against verifiers' API only; tandemrl
loads it by its package name (``verifiers.env: word_lookup``, this package's parent in ``verifiers.paths``).
"""

from word_lookup.taskset import WordLookupTaskset

__all__ = ["WordLookupTaskset"]
