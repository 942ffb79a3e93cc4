"""Tools ▸ Compare: the chat's reply under each cache setting (lossless ones must match) and its dialog; and fidelity
on the chat (Memory's "Check fidelity", Compare's bytes-against-quality front: ``fidelity``, ``fidelity_plot``,
``fidelity_tab``). Their runs on the engine's thread are the link's (``app.link.comparison``,
``app.link.fidelity_task``). May import ``app.link``, ``app.controls`` and the ground.
"""
