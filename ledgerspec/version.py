"""The one version source: ``pyproject.toml`` reads it (hatch ``[tool.hatch.version]``), ``ledgerspec.__version__``
re-exports it, and every wing may import it."""

__version__ = "0.1.0"
