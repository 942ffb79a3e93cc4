"""The chat on screen: the pane (transcript, message box, bubbles, markdown), the conversation controller
(send, regenerate, edit, stop, versions, notes in the app's words), the chat list, export and the send check.

May import ``app.shell``'s parts (notices, glossary, status bar, widgets), ``app.history``, ``app.settings``,
``app.link`` and the engine's public face.
"""
