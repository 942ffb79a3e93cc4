"""The command-line tools: ``cli`` (``python -m engine generate|serve|bench|quality|attach``), ``bench`` and its
scenarios, ``quality``, ``compare`` (the app's Compare too), and reading the user's file arguments (``inputs``,
``arguments``: size-capped, never blocking, one-line errors).

May import every engine room; nothing imports the tools but ``engine.__main__`` and the app's Compare.
"""
