"""Engine files: ``export_engine`` writes an engine directory that ``Engine.from_engine`` runs without compiling."""
from .capture import ExportError
from .export import export_engine

__all__ = ["ExportError", "export_engine"]
