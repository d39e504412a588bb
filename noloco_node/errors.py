"""The one error type of the data path: a corpus, dataset file, tokenizer or model file that cannot be used.

Its message always names the file (and, where there is one, the line, field or column) and says what to change;
the command line prints it and exits 2 without changing anything.
"""

from __future__ import annotations


class DataError(ValueError):
    """A data source, tokenizer or exported model that cannot be used; the message names the file and the fix."""
