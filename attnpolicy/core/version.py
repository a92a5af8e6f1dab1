"""The version of attnpolicy (``attnpolicy.__version__``)."""

__version__ = "0.1.0"
