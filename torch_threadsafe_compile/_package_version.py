"""The package's own version, in a leaf module (read by setup.cfg, ``status()`` and ``--version``)."""

__version__ = "0.2.0"
