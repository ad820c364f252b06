"""CUDA C sources (``*.cu``) and the loader that compiles them through CuPy."""

from .loader import available, get_kernel, kernel_source, load, name_expressions, show_source, source

__all__ = ["available", "get_kernel", "kernel_source", "load", "name_expressions", "show_source", "source"]
