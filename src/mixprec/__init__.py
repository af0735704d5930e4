"""mixprec: mixed-precision training for PyTorch."""

__version__ = "0.1.0"
