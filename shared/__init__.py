"""The library every service imports: settings, schemas, storage, tokenization, extraction, progress."""

__version__ = "0.1.0"
