"""The command-line tools: ``cli`` (``python -m engine generate|serve|bench|quality|attach``), ``bench`` and its
scenarios, ``quality``, ``compare`` (the app's Compare too), and checking the user's arguments (``arguments``; files are read through
``engine.inputs``: size-capped, never blocking, one-line errors).

May import every engine room; nothing imports the tools but ``engine.__main__`` and the app's Compare.
"""
