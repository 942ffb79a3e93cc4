"""Serving the loaded model from the app (Server ▸ Start serving) and the API conversations' read-only view.
May import ``app.chat``'s pane parts, ``app.shell``'s widgets and ``engine.server``.
"""
