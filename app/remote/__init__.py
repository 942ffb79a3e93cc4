"""Remote chats: a chat with a model on an OpenAI-compatible server (vLLM, ``engine serve``) whose panels are
drawn from the server's KV events — connecting, the link thread, the remote panels' readouts, their redraw,
saved remote chats and their list. Uses ``engine.remote`` for the wire; may import ``app.chat``'s pane
parts, ``app.history`` and ``app.shell``'s widgets.
"""
