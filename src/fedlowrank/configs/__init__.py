"""Bundled run configurations (``fedlowrank run main``)."""
