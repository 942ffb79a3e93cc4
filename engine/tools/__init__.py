"""The command-line tools' shared parts: reading the user's files (``inputs``), checking arguments before any
work (``arguments``), a library's repeated log line shown once (``log_once``).

May import ``engine``'s public face (config, errors) and the standard library; nothing here imports torch.
"""
