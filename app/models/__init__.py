"""Choosing and loading a model: the Models dialog (local folders, hub downloads, the memory estimate before
loading) and the controller that loads on the worker and keeps the recent list. May import ``app.settings``,
``app.shell``'s parts and ``app.link``.
"""
