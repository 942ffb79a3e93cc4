"""Live cache panels. Each is a small widget with one ``show_snapshot(snapshot)`` slot; plot items are
created once in ``__init__`` and fed by setters. ``updates`` counts the snapshots a panel has drawn."""

from app.panels.base import Panel
from app.panels.memory import MemoryPanel
from app.panels.model_card import ModelCardPanel
from app.panels.occupancy import OccupancyPanel
from app.panels.page_map import PageMapPanel
from app.panels.timing import TimingPanel
from app.panels.why import WhyPanel

__all__ = ["Panel", "OccupancyPanel", "PageMapPanel", "TimingPanel", "MemoryPanel", "ModelCardPanel", "WhyPanel"]
