"""OpenAI-compatible agent proxy with exact token-level trajectories (see docs/agents.md)."""

from tandemrl.workflows.proxy.server import AgentProxy, AgentSession
from tandemrl.workflows.proxy.tool_parsers import ParsedReply, get_tool_parser, register_tool_parser
from tandemrl.workflows.proxy.trajectory import CallRecord, Session, Trajectory

__all__ = [
    "AgentProxy",
    "AgentSession",
    "CallRecord",
    "ParsedReply",
    "Session",
    "Trajectory",
    "get_tool_parser",
    "register_tool_parser",
]
