"""The engine core: ``EngineCore`` (every request of a loaded model, its rounds, admission, room and
preemption; a request's one lifecycle is ``RequestStatus``, held by its reply's record), ``ChatSession`` and its step (``prepare`` / forward /
``finish``), ``Sequence`` (a conversation's ids and turn), ``SeqCache`` (a sequence's cache, its one writer:
each forward's ``StepRecord``), eviction, reconfiguring a cache mid-chat, ``observe`` (snapshots from
records), sampling, the session pool, teacher forcing.

May import ``engine.model``, ``engine.kv``, ``engine.policies``, ``engine.speculation`` and the public face;
never ``engine.server``, ``engine.tools`` or ``engine.remote``.
"""
