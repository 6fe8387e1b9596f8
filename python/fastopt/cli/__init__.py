"""The `fastopt` command: one module per command."""
