"""The command-line tools' shared parts: reading the user's files (``inputs``).

May import ``engine``'s public face (config, errors) and the standard library; nothing here imports torch.
"""
