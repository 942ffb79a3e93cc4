"""Attaching to a remote server (``engine attach``, the app's remote chats): HTTP client with deadlines and
size caps, the KV events' wire format, the subscriber thread, the remote block pool view, why a remote prompt was
recomputed (``why``). Trusts nothing the server sends. Imports only ``engine.errors``, ``engine.kv.paged.tenants``
(the names a keyed server gives blocks), ``engine.snapshot`` (the cache account's vocabulary) and itself.
"""
