"""The ground every app room stands on: numbers and sizes in words (``format``), the glossary of the engine's
names, the words for reuse, notes and failures, the theme, small widgets, docks, notices, the status bar, and the
record of what is on screen (``screen``, an evented record).

Imports no other app room: only Qt and the engine's public face (config, errors, snapshot, vocab, sizes).
"""
