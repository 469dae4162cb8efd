"""The command line: click commands that parse, build the library's configuration and call it."""
