"""Exceptions shared by every stage of the pipeline."""


class DecodeError(ValueError):
    """An image could not be decoded.

    The message says what is wrong; ``path`` names the file when the bytes came
    from one (``None`` for in-memory data).
    """

    def __init__(self, message, path=None):
        self.reason = str(message)
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {self.reason}" if self.path else self.reason)

    def __reduce__(self):
        # Crosses process boundaries from workers intact.
        return (type(self), (self.reason, self.path))


class ReadLimitError(OSError):
    """A sample's file was refused before reading it whole: not a regular file (a
    FIFO, a device), or larger than ``max_file_bytes``."""
