"""The command-line tools: ``cli`` (``python -m engine generate|serve|bench|quality|attach``), ``bench`` and its
scenarios, ``quality``, ``compare`` (the app's Compare too), and reading what the user or a file gives (``inputs``: regular files only, size-capped, never
blocking, one-line errors — also used by ``engine.remote`` and the disk tier's headers; ``arguments``).

May import every engine room; nothing imports the tools but ``engine.__main__``, the app's Compare and, for
``inputs`` alone, the rooms that read untrusted input.
"""
