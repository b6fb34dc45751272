"""Retired module: its class moved to ``tandemrl.algorithms.sft`` (see ``tandemrl.api.renamed``)."""

from typing import TYPE_CHECKING

from tandemrl.api.renamed import retired_names

if not TYPE_CHECKING:  # mypy keeps reporting unknown names
    __getattr__ = retired_names(__name__)
