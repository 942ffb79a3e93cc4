"""Settings declared once (key, type, default) over an INI ``QSettings``, and the cache setting kept in them.
Imports only Qt and the engine's config.
"""
