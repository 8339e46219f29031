"""Command-line interface: thin commands that call into the library layers."""
