"""The package version: one place, read by ``pyproject.toml``, ``llmgpu --version`` and result files."""

__version__ = "0.1.0"
