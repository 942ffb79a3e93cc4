"""Tools ▸ Compare: the chat's reply under each cache setting (lossless ones must match), its dialog and its
run on the worker (a background task of the engine core). May import ``app.link`` and ``app.shell``'s parts.
"""
