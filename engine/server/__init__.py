"""The OpenAI-compatible HTTP server on the engine (``python -m engine serve``), with Anthropic's Messages API.

``service`` (KVServer, ServerThread, serve), ``app`` (routes), ``schemas`` (request checks), ``scheduler``
(the engine thread), ``sessions`` (idle conversations and their caches), ``metrics``, ``errors``, ``stops``;
agents: ``tool_request`` (tools and tool messages checked), ``render`` (the chat template with tools),
``constrain`` (grammars for structured output and forced calls), ``tool_calls`` (the formats: reading calls,
their grammars), ``places`` (where a recomputed range sits), ``anthropic`` / ``anthropic_request``.
Importing this package pulls in Starlette; the engine's other modules never import it.
"""

from engine.server.service import KVServer, ServerOptions, ServerThread

__all__ = ["KVServer", "ServerOptions", "ServerThread"]
