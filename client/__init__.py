"""Client library and command line. Lands with its own issue."""
