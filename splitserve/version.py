"""splitserve's version, in a module of its own so that any layer can report it without importing the
package's facade (splitserve/__init__.py)."""

__version__ = "0.1.0"
