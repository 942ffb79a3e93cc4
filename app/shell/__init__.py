"""The window and what frames every room: main window, menus, docks, status bar, notices, help and glossary,
theme, small widgets, the readouts router (one chat's snapshots to the panels, trace and status bar), failures.

May import every app room and the engine's public face (config, errors, snapshot, vocab); the rooms never
import the window (``app.shell.window``).
"""
