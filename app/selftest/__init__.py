"""``kvscope --self-test``: the real window offscreen, chatting in every cache mode, switching mid-reply,
checking every panel and readout; its checks of the window's readouts and of speculative decoding.
May import every app room (it drives the whole window).
"""
