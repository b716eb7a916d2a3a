"""offspec: run LLMs too big for one GPU, fast — a layer-streamed target verified against dynamic token trees
grown by a resident draft (DySpec), with output exactly the target's own."""

__version__ = "0.1.0"
