"""Known failures. The CLI turns any OffspecError into one line on stderr and a non-zero exit."""


class OffspecError(Exception):
    """A failure the user can act on; its message is the whole story, one line."""


class CheckpointError(OffspecError):
    """Missing, unsupported or corrupt model files."""


class StoreError(OffspecError):
    """A packed disk store that is missing, stale or corrupt."""


class BudgetError(OffspecError):
    """A memory budget too small for what was asked."""


class InputError(OffspecError):
    """Bad prompts, prompt files, options or output paths."""
