"""Command-line entry points: thin wrappers that parse arguments, call package functions and print."""
