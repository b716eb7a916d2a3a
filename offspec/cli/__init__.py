"""The `offspec` command: one module per command, the shared options in one."""
