"""Attaching to a remote server (``engine attach``, the app's remote chats): HTTP client with deadlines and
size caps, the KV events' wire format, the subscriber thread, the remote block pool view. Trusts nothing the
server sends. Imports only ``engine.errors``, ``engine.kv.paged.tenants`` (the names a keyed server gives blocks) and itself.
"""
