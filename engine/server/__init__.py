"""The OpenAI-compatible HTTP server on the engine (``python -m engine serve``).

``service`` (KVServer, ServerThread, serve), ``app`` (routes), ``schemas`` (request checks), ``scheduler``
(the engine thread), ``sessions`` (idle conversations and their caches), ``metrics``, ``errors``, ``stops``.
Importing this package pulls in Starlette; the engine's other modules never import it.
"""

from engine.server.service import KVServer, ServerOptions, ServerThread

__all__ = ["KVServer", "ServerOptions", "ServerThread"]
