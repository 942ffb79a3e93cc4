"""Tools ▸ Compare: the chat's reply under each cache setting (lossless ones must match), its dialog and its
run on the worker (a background task of the engine core); and fidelity on the chat (Memory's "Check fidelity",
Compare's bytes-against-quality front: ``fidelity``, ``fidelity_task``, ``fidelity_plot``, ``fidelity_tab``).
May import ``app.link`` and ``app.shell``'s parts.
"""
