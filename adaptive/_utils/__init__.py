"""Internal helpers shared by the library's layers (not public API)."""
