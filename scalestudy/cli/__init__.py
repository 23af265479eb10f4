"""The command line: the parser and `main`, the commands' handlers, argument types."""
