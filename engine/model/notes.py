"""Messages a load says to the user before its weights are read (torch-free: the memory verdict and the app import
it without the model's libraries)."""

from __future__ import annotations


class LoadNote(str):
    """A progress message the user must see, not only a stage: what loading does to the weights and the memory
    they will take, said before they are read (``engine.model.gguf_load.load_note``, ``engine.model.fit``). The app
    shows it as any progress message; the command line prints these alone (``print_notes``)."""


def print_notes(message: str, fraction: float) -> None:
    """A ``Progress`` for the command line: each ``LoadNote`` as a ``note:`` line on stderr, stages unsaid."""
    import sys

    if isinstance(message, LoadNote):
        print(f"note: {message}", file=sys.stderr, flush=True)
