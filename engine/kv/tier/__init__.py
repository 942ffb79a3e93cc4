"""The KV disk tier: page files (their format, checked before a byte is trusted), the folder and its budget
shared between processes, the model's fingerprint, restore and save off the decode path.
May import ``engine.kv.paged`` and ``engine.kv.store``.
"""
