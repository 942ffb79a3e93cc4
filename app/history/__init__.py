"""The chat history: SQLite (WAL) written incrementally, its records, damaged-file recovery and the notices
about the file. Qt-free except the notices; may import ``app.ground.failure`` and nothing of the other rooms.
"""
