"""The project's one exception base class, and the error of the data path.

Every error this project raises on purpose derives from :class:`NolocoError`, so a caller (the command line, a
test, a program that embeds a node) can tell "noloco-node refused this, and says why" from a bug. Each subsystem
names its own subclass next to its code (``SettingsError``, ``PayloadError``, ``ExchangeError``, ``NodeError``,
...); messages name the setting, file, peer or field at fault and what to change.
"""

from __future__ import annotations


class NolocoError(Exception):
    """Something noloco-node refused or could not do, with a message that says why."""


class DataError(NolocoError, ValueError):
    """A data source, tokenizer or exported model that cannot be used; the message names the file and the fix.

    Its message always names the file (and, where there is one, the line, field or column); the command line prints
    it and exits 2 without changing anything."""
